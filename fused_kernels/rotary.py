"""Rotary math in PyTorch: MRoPE angles from 3-D positions (interleaved or blocked sections) and
rotate-half. The model's unfused path and fused_kernels/fused_mrope.py's reference both run it (here,
below the model, so that the kernel's reference imports nothing above fused_kernels/).

Each rotary frequency index i (0 <= i < rot_dim/2) reads its position from one axis:
index i = 3j+1 (j < section[1]) reads the height position, i = 3j+2 (j < section[2]) the
width position, every other index the temporal/text position. For text tokens the three
axes are equal, so MRoPE reduces to ordinary RoPE there. Rotation is rotate-half over the
first ``rot_dim`` channels of each head; the rest of the head passes through unchanged.
"""

from __future__ import annotations

import torch


def inverse_frequencies(rot_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))


def axis_of_frequency(half_dim: int, mrope_section: list[int], interleaved: bool = True) -> torch.Tensor:
    """For each of the rot_dim/2 frequencies, which axis (0=t, 1=h, 2=w) supplies its position."""
    if sum(mrope_section) != half_dim:
        raise ValueError(f"mrope_section {mrope_section} must sum to rotary_dim/2 = {half_dim}")
    axis = torch.zeros(half_dim, dtype=torch.long)
    if interleaved:
        for a in (1, 2):
            axis[a : mrope_section[a] * 3 : 3] = a
    else:
        axis[mrope_section[0] : mrope_section[0] + mrope_section[1]] = 1
        axis[mrope_section[0] + mrope_section[1] :] = 2
    return axis


def mrope_angles(position_ids: torch.Tensor, inv_freq: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
    """Rotation angles, [..., rot_dim], from position ids [3, ...]. Computed in fp32."""
    pos = position_ids.to(torch.float32)  # [3, *shape]
    # pick, for every frequency, the position of its axis: [*shape, half]
    picked = pos.movedim(0, -1)[..., axis.to(pos.device)]
    angles = picked * inv_freq.to(pos.device)
    return torch.cat([angles, angles], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate the first angles.shape[-1] channels of x; angles broadcast over x's head dim.

    x: [..., H, D]; angles: [..., 1, rot_dim] (same leading shape as x). The product is
    taken in x's dtype after computing cos/sin in fp32, as the reference does for text.
    """
    rot = angles.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    out = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat([out, x_pass], dim=-1) if x_pass.numel() else out
