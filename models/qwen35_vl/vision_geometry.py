"""The vision encoder's per-batch geometry: from ``image_grid_thw`` (on the host) the attention
segments, the 2-D rotary positions and the learned position table's bilinear taps, moved once to
the device. Apart from the encoder (models/qwen35_vl/vision.py) so that its CUDA graphs
(models/qwen35_vl/vision_graphs.py) can build static geometries without importing the encoder.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from core.transfer import to_device_async


@dataclass
class VisionGeometry:
    """Per-batch tensors derived from image_grid_thw on the host, moved once to the device."""

    cu_seqlens: torch.Tensor  # [frames+1] int32, patches per frame
    max_seqlen: int
    rot_pos: torch.Tensor  # [N_patches, 2] (row, col) in merge-block order
    interp_index: torch.Tensor  # [N_patches, 4] rows of the learned position table
    interp_weight: torch.Tensor  # [N_patches, 4]
    one_segment: bool = False  # one frame of one image: attention needs no offsets (cuDNN, dense)
    static_shape: bool = False  # a CUDA graph bucket's layout, replayed again and again


def vision_geometry(grid_thw: torch.Tensor, merge: int, grid_side: int, device) -> VisionGeometry:
    grid, parts = _image_parts(grid_thw, merge, grid_side)
    frames = [h * w for t, h, w in grid for _ in range(t)]
    cu = torch.tensor([0] + frames, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return VisionGeometry(
        cu_seqlens=to_device_async(cu, device),
        max_seqlen=max(frames) if frames else 0,
        rot_pos=to_device_async(_cat([p[0] for p in parts], (0, 2), torch.long), device),
        interp_index=to_device_async(_cat([p[1] for p in parts], (0, 4), torch.long), device),
        interp_weight=to_device_async(_cat([p[2] for p in parts], (0, 4), torch.float32), device),
        one_segment=len(frames) == 1,
    )


def warm_geometry(grid_thw: torch.Tensor, merge: int, grid_side: int) -> None:
    """Compute (and cache) the geometry of each image of ``grid_thw`` ahead of the forward: the
    data pipeline's prefetch thread calls this (``ModelFamily.prepare_host_batch``), so the training
    thread only concatenates cached tensors. The cached tensors are never modified, so a thread
    computing an entry the other also computes is harmless."""
    _image_parts(grid_thw, merge, grid_side)


def _image_parts(grid_thw: torch.Tensor, merge: int, grid_side: int) -> tuple[list[tuple], list[tuple]]:
    """(the (t, h, w) of each image, its cached geometry). Per image from a cache: building them
    is Python-heavy, and image sizes repeat."""
    grid = [tuple(g) for g in grid_thw.detach().to("cpu", torch.long).tolist()]
    return grid, [_image_geometry(t, h, w, merge, grid_side) for t, h, w in grid]


def _cat(tensors: list[torch.Tensor], empty_shape, dtype) -> torch.Tensor:
    return torch.cat(tensors) if tensors else torch.zeros(empty_shape, dtype=dtype)


@functools.lru_cache(maxsize=4096)
def _image_geometry(t: int, h: int, w: int, merge: int, grid_side: int):
    """(rot_pos [t*h*w, 2], interp_index [t*h*w, 4], interp_weight [t*h*w, 4]) of one image, on
    the host; callers concatenate (never modify) them."""
    r = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
    c = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
    # merge-block order: (block_row, block_col, in_row, in_col)
    row = r.permute(0, 2, 1, 3).reshape(-1).repeat(t)
    col = c.permute(0, 2, 1, 3).reshape(-1).repeat(t)
    # bilinear resampling of the square learned table, align_corners=True
    h_idx, h_w = _taps(row, torch.full_like(row, h), grid_side)
    w_idx, w_w = _taps(col, torch.full_like(col, w), grid_side)
    index = (h_idx[:, :, None] * grid_side + w_idx[:, None, :]).reshape(-1, 4)
    weight = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    return torch.stack([row, col], -1), index, weight


def _taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1).float()
    lo = src.floor()
    taps = torch.stack([lo, lo + 1], -1).long().clamp(0, side - 1)
    frac = (src - lo)[:, None]
    weights = torch.cat([1 - frac, frac], -1)
    return taps, weights
