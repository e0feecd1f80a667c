"""Image -> vision-encoder patches, in the exact layout of the Hugging Face Qwen2-VL/Qwen3.5
image processor, so that weights trained here read real checkpoints' inputs the same way.

The vision tower's patch embedding is a Conv3d over (C, temporal_patch, p, p) blocks, and its
patch merger fuses each ``merge x merge`` window of neighbouring patches; HF therefore orders
the patch rows window by window (all patches of one merge window are consecutive) and the
features of a row as (C, t, y, x). ``patchify`` reproduces that ordering bit for bit.
"""

from __future__ import annotations

import torch

IMAGE_MEAN = (0.5, 0.5, 0.5)  # Qwen3.5 / Qwen3-VL processor defaults; a checkpoint's
IMAGE_STD = (0.5, 0.5, 0.5)  # preprocessor_config.json overrides them (data.image_mean/std)


def patchify(
    image: torch.Tensor, patch_size: int, temporal_patch_size: int, merge: int,
    mean=IMAGE_MEAN, std=IMAGE_STD,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise and cut one image [C, H, W] (values in [0, 1]) into patch rows.

    Returns ``pixel_values`` [grid_t*gh*gw, C*tp*p*p] float32 and ``grid_thw`` = (1, H/p, W/p).
    A still image is one frame repeated ``temporal_patch_size`` times (grid_t = 1), as in HF.
    """
    if image.dim() != 3:
        raise ValueError(f"patchify expects an image [C, H, W], got shape {tuple(image.shape)}")
    return patchify_frames(image.unsqueeze(0), patch_size, temporal_patch_size, merge, mean, std)


def patchify_frames(
    frames: torch.Tensor, patch_size: int, temporal_patch_size: int, merge: int,
    mean=IMAGE_MEAN, std=IMAGE_STD,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise and cut frames [T, C, H, W] (values in [0, 1]) into patch rows.

    Frames are grouped ``temporal_patch_size`` at a time (grid_t = ceil(T / tp)); a short last
    group repeats the last frame, as HF's image and video processors do (a still image is one
    frame, repeated). Returns ``pixel_values`` [grid_t*gh*gw, C*tp*p*p] float32 and
    ``grid_thw`` = (grid_t, H/p, W/p).
    """
    if frames.dim() != 4 or frames.shape[0] == 0:
        raise ValueError(f"patchify_frames expects frames [T, C, H, W], T >= 1, got shape {tuple(frames.shape)}")
    _, c, h, w = frames.shape
    unit = patch_size * merge
    if h % unit or w % unit:
        raise ValueError(
            f"image size {h}x{w} (HxW) must be a multiple of patch_size*merge = "
            f"{patch_size}*{merge} = {unit} on both sides; resize or crop it first"
        )
    p, tp, m = patch_size, temporal_patch_size, merge
    mean_t = torch.as_tensor(mean, dtype=torch.float32).reshape(-1, 1, 1)
    std_t = torch.as_tensor(std, dtype=torch.float32).reshape(-1, 1, 1)
    x = (frames.to(torch.float32) - mean_t) / std_t
    if pad := -x.shape[0] % tp:
        x = torch.cat([x, x[-1:].expand(pad, c, h, w)])
    grid_t, gh, gw = x.shape[0] // tp, h // p, w // p
    x = x.reshape(grid_t, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (t, gh/m, gw/m, m, m, C, tp, p, p)
    pixel_values = x.reshape(grid_t * gh * gw, c * tp * p * p).contiguous()
    grid_thw = torch.tensor([grid_t, gh, gw], dtype=torch.long)
    return pixel_values, grid_thw
