"""Images -> vision-encoder inputs as the Hugging Face Qwen image processor makes them: RGB
decoding, Qwen's ``smart_resize`` into a pixel-area range, then ``patchify`` (the encoder's
patch layout, models/common/vision_patches.py).
"""

from __future__ import annotations

import math

import torch

from models.common.vision_patches import IMAGE_MEAN, IMAGE_STD, patchify


# The released Qwen3.5 checkpoints' preprocessor_config.json ("size": {"shortest_edge": 65536,
# "longest_edge": 16777216}): the pixel area every image is resized into. A preprocessor_config.json
# beside data.tokenizer replaces them (multimodal/config.py reads it).
CHECKPOINT_MIN_PIXELS = 65_536
CHECKPOINT_MAX_PIXELS = 16_777_216


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen's ``smart_resize``: sides multiples of ``factor``, area in [min, max], aspect kept.

    The first rounding may give a side of 0 (a side of ``factor / 2`` or less, e.g. a text-line
    crop): as in transformers' processor it is not raised to ``factor`` there, the area falls below
    ``min_pixels`` and both sides are scaled up together, so the aspect is kept instead of one side
    being padded out on its own (tests/test_image_processing.py pins the thin sizes)."""
    if max(height, width) / max(1, min(height, width)) > 200:
        raise ValueError(f"aspect ratio of {height}x{width} is over 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
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
    colour), as transformers' ``convert_to_rgb`` (the image processor's) does: dropping alpha
    instead shows the model whatever colour the transparent pixels happen to store. qwen-vl-utils'
    ``to_rgb`` paints only RGBA onto white; it converts LA and transparent palettes with
    ``convert("RGB")``, which drops their alpha."""
    from PIL import Image

    if img.mode == "RGB":
        return img
    rgba = img.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def open_image(source):
    """Decode an image from bytes or a path, fully loaded (a corrupt file fails here, not later),
    upright: its EXIF orientation applied, as transformers' ``load_image`` does for paths, URLs
    and base64 (a phone photo stored sideways would otherwise reach the model rotated, with its
    grid's height and width swapped). qwen-vl-utils does not apply it (docs/data.md)."""
    import io

    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source) as im:
        im.load()
        upright = ImageOps.exif_transpose(im)  # a new image when rotated, else a copy
        return to_rgb(upright) if upright.mode != "RGB" else upright


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
