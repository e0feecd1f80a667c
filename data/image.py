"""Image -> vision-encoder patches, in the exact layout of the Hugging Face Qwen2-VL/Qwen3.5
image processor, so that weights trained here read real checkpoints' inputs the same way.

The vision tower's patch embedding is a Conv3d over (C, temporal_patch, p, p) blocks, and its
patch merger fuses each ``merge x merge`` window of neighbouring patches; HF therefore orders
the patch rows window by window (all patches of one merge window are consecutive) and the
features of a row as (C, t, y, x). ``patchify`` reproduces that ordering bit for bit.
"""

from __future__ import annotations

import math

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
    c, h, w = image.shape
    unit = patch_size * merge
    if h % unit or w % unit:
        raise ValueError(
            f"image size {h}x{w} (HxW) must be a multiple of patch_size*merge = "
            f"{patch_size}*{merge} = {unit} on both sides; resize or crop it first"
        )
    p, tp, m = patch_size, temporal_patch_size, merge
    mean_t = torch.as_tensor(mean, dtype=torch.float32).reshape(-1, 1, 1)
    std_t = torch.as_tensor(std, dtype=torch.float32).reshape(-1, 1, 1)
    x = (image.to(torch.float32) - mean_t) / std_t
    frames = x.unsqueeze(0).expand(tp, c, h, w)  # [tp, C, H, W]: the frame repeated
    grid_t, gh, gw = 1, h // p, w // p
    x = frames.reshape(grid_t, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (t, gh/m, gw/m, m, m, C, tp, p, p)
    pixel_values = x.reshape(grid_t * gh * gw, c * tp * p * p).contiguous()
    grid_thw = torch.tensor([grid_t, gh, gw], dtype=torch.long)
    return pixel_values, grid_thw


# The released Qwen3.5 checkpoints' preprocessor_config.json ("size": {"shortest_edge": 65536,
# "longest_edge": 16777216}): the pixel area every image is resized into. A preprocessor_config.json
# beside data.tokenizer replaces them (multimodal/config.py reads it).
CHECKPOINT_MIN_PIXELS = 65_536
CHECKPOINT_MAX_PIXELS = 16_777_216


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen's ``smart_resize``: sides multiples of ``factor``, area in [min, max], aspect kept."""
    if max(height, width) / max(1, min(height, width)) > 200:
        raise ValueError(f"aspect ratio of {height}x{width} is over 200")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def to_rgb(img):
    """A PIL image as RGB, transparency painted onto white (RGBA, LA, palette with a transparent
    colour), as transformers' ``convert_to_rgb`` and qwen-vl-utils do: dropping alpha instead
    shows the model whatever colour the transparent pixels happen to store."""
    from PIL import Image

    if img.mode == "RGB":
        return img
    rgba = img.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def open_image(source):
    """Decode an image from bytes or a path, fully loaded (a corrupt file fails here, not later)."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source) as im:
        im.load()
        return to_rgb(im) if im.mode != "RGB" else im.copy()


def image_patches(img, patch_size: int, temporal_patch_size: int, merge: int, min_pixels: int,
                  max_pixels: int, mean=IMAGE_MEAN, std=IMAGE_STD) -> tuple[torch.Tensor, torch.Tensor]:
    """An RGB PIL image -> (pixel_values, grid_thw) as Qwen's image processor makes them:
    smart_resize into [min_pixels, max_pixels], bicubic resize (PIL), rescale to [0, 1], normalise,
    patchify. Equal to transformers' Qwen2VLImageProcessorPil (tests/test_image_processing.py)."""
    import numpy as np
    from PIL import Image

    h, w = smart_resize(img.height, img.width, patch_size * merge, min_pixels, max_pixels)
    img = img.resize((w, h), Image.Resampling.BICUBIC)
    x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return patchify(x, patch_size, temporal_patch_size, merge, mean, std)
