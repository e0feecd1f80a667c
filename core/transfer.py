"""Host -> device copies that never stall the host."""

from __future__ import annotations

import torch


def to_device_async(t: torch.Tensor, device) -> torch.Tensor:
    """Copy a host tensor to ``device`` asynchronously.

    A CUDA copy from pageable host memory waits for the stream to drain before it starts (the
    step's profile showed the GPU idle at such copies of per-batch metadata), so the
    tensor is pinned first; torch's caching host allocator reuses pinned blocks, so that is cheap
    after the first batches. Other devices get a plain copy.
    """
    device = torch.device(device)
    if device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
