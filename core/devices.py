"""What the accelerator can run: one place for the checks the fast paths share."""

from __future__ import annotations

import torch


def hopper_reason(device: torch.device, what: str) -> str | None:
    """None when ``device`` is a CUDA GPU of compute capability >= 9.0 (Hopper and later), else why
    ``what`` cannot run there, for the fast path's one fallback warning."""
    if device.type != "cuda":
        return f"tensors on {device.type}; {what} needs a CUDA GPU"
    cc = torch.cuda.get_device_capability(device)
    if cc < (9, 0):
        return f"compute capability {cc} < (9, 0); {what} needs Hopper or later"
    return None
