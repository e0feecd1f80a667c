"""Images as the released checkpoints see them: our decode + resize + normalise + patch order equals
transformers' Qwen2-VL/Qwen3.5 image processor (PIL backend) for every kind of image, alpha is
painted onto white, and the pixel range comes from the checkpoint's preprocessor_config.json."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from data.image import CHECKPOINT_MAX_PIXELS, CHECKPOINT_MIN_PIXELS, image_patches, open_image, smart_resize

P, TP, M = 16, 2, 2
MEAN = STD = (0.5, 0.5, 0.5)


def _hf(img, min_pixels, max_pixels):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=P, temporal_patch_size=TP, merge_size=M, image_mean=list(MEAN),
                                    image_std=list(STD), min_pixels=min_pixels, max_pixels=max_pixels,
                                    )(images=[img], return_tensors="pt")


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _images():
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (150, 230, 3), dtype=np.uint8)
    alpha = rng.integers(0, 256, (150, 230), dtype=np.uint8)
    alpha[:40] = 0  # fully transparent rows: their stored colour must not show
    palette = Image.fromarray(rgb).quantize(16)
    palette.info["transparency"] = 3  # one palette entry is transparent
    return {
        "rgb": Image.fromarray(rgb),
        "rgba": Image.fromarray(np.dstack([rgb, alpha]), "RGBA"),
        "palette_transparent": palette,
        "gray": Image.fromarray(rgb[..., 0], "L"),
        "gray_alpha": Image.fromarray(np.dstack([rgb[..., 0], alpha]), "LA"),
        "tiny": Image.fromarray(rgb[:5, :7]),
        "wide": Image.fromarray(rng.integers(0, 256, (40, 900, 3), dtype=np.uint8)),
    }


@pytest.mark.parametrize("kind", sorted(_images()))
def test_pixels_and_grid_equal_transformers(kind):
    """Through a PNG round trip, as a data set delivers them; the range is the checkpoints' lower
    bound and a small upper one (the checkpoints' 16.7M-pixel bound is checked on grids below)."""
    img = _images()[kind]
    ours_img = open_image(_png(img))
    assert ours_img.mode == "RGB"
    lo, hi = CHECKPOINT_MIN_PIXELS, 4 * CHECKPOINT_MIN_PIXELS
    ours, grid = image_patches(ours_img, P, TP, M, lo, hi, MEAN, STD)
    hf = _hf(Image.open(io.BytesIO(_png(img))), lo, hi)
    assert hf["image_grid_thw"][0].tolist() == grid.tolist()
    torch.testing.assert_close(ours, hf["pixel_values"], rtol=0, atol=1e-6)


def test_transparency_is_white():
    rgba = np.zeros((32, 32, 4), dtype=np.uint8)
    rgba[..., 0] = 200  # red stored under fully transparent pixels
    out = np.asarray(open_image(_png(Image.fromarray(rgba, "RGBA"))))
    assert (out == 255).all()
    half = rgba.copy()
    half[..., 3] = 128
    out = np.asarray(open_image(_png(Image.fromarray(half, "RGBA"))))
    assert abs(int(out[0, 0, 0]) - 228) <= 1 and abs(int(out[0, 0, 1]) - 127) <= 1  # 200*a + 255*(1-a)


@pytest.mark.parametrize("h, w", [(3000, 2000), (8000, 6000), (20000, 300), (5, 7), (256, 256), (4096, 4096)])
def test_grid_at_the_checkpoint_range_equals_transformers(h, w):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    ours = smart_resize(h, w, P * M, CHECKPOINT_MIN_PIXELS, CHECKPOINT_MAX_PIXELS)
    assert ours == tuple(hf_smart_resize(h, w, P * M, CHECKPOINT_MIN_PIXELS, CHECKPOINT_MAX_PIXELS))
    assert CHECKPOINT_MIN_PIXELS <= ours[0] * ours[1] <= CHECKPOINT_MAX_PIXELS
    if (h, w) == (3000, 2000):  # the photo: 5,828 image tokens, not 247
        assert ours[0] * ours[1] // (P * M) ** 2 == 5828


def test_pixel_range_from_preprocessor_config(tmp_path):
    from data.tiny_tokenizer import build_tiny_tokenizer
    from multimodal.config import load_config, resolve_sources

    tok_dir = tmp_path / "tok"
    build_tiny_tokenizer(tok_dir)
    cfg = resolve_sources(load_config(None, [f"data.tokenizer={tok_dir}"]))
    assert (cfg.data.min_pixels, cfg.data.max_pixels) == (CHECKPOINT_MIN_PIXELS, CHECKPOINT_MAX_PIXELS)
    pre = {"size": {"shortest_edge": 3136, "longest_edge": 1003520}, "patch_size": 16, "merge_size": 2,
           "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    (tok_dir / "preprocessor_config.json").write_text(json.dumps(pre))
    cfg = resolve_sources(load_config(None, [f"data.tokenizer={tok_dir}"]))
    assert (cfg.data.min_pixels, cfg.data.max_pixels) == (3136, 1003520)
    # Qwen2-VL's spelling
    (tok_dir / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 4096, "max_pixels": 65536}))
    cfg = resolve_sources(load_config(None, [f"data.tokenizer={tok_dir}"]))
    assert (cfg.data.min_pixels, cfg.data.max_pixels) == (4096, 65536)
    # a value the user sets wins over the file
    cfg = resolve_sources(load_config(None, [f"data.tokenizer={tok_dir}", "data.max_pixels=32768"]))
    assert (cfg.data.min_pixels, cfg.data.max_pixels) == (4096, 32768)


def test_bad_pixel_range_names_the_field():
    from multimodal.config import ConfigError, load_config, validate

    with pytest.raises(ConfigError, match="data.min_pixels"):
        validate(load_config(None, ["data.min_pixels=5000", "data.max_pixels=4096"]))


# Sizes where our smart_resize used to raise a side of factor/2 or less to factor before the pixel
# range, and transformers' does not (issue 42): text-line crops, both orientations, and a square.
@pytest.mark.parametrize("h, w, lo, hi", [(16, 200, 4096, 65536), (15, 2900, CHECKPOINT_MIN_PIXELS, CHECKPOINT_MAX_PIXELS),
                                          (2900, 15, CHECKPOINT_MIN_PIXELS, CHECKPOINT_MAX_PIXELS),
                                          (12, 300, 4096, 65536), (8, 1000, 4096, 65536), (16, 16, 4096, 65536)])
def test_thin_images_equal_transformers(h, w, lo, hi):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    assert smart_resize(h, w, P * M, lo, hi) == tuple(hf_smart_resize(h, w, P * M, lo, hi))
    img = Image.fromarray(np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8))
    ours, grid = image_patches(open_image(_png(img)), P, TP, M, lo, hi, MEAN, STD)
    hf = _hf(Image.open(io.BytesIO(_png(img))), lo, hi)
    assert hf["image_grid_thw"][0].tolist() == grid.tolist()
    torch.testing.assert_close(ours, hf["pixel_values"], rtol=0, atol=1e-6)
    if (h, w) == (15, 2900):  # the crop: 224 patches wide, not 182
        assert grid.tolist() == [1, 2, 224]


def _jpeg_with_orientation(orientation: int) -> bytes:
    """A 48x80 (h x w) JPEG stored sideways, as a phone writes it, with an EXIF Orientation tag."""
    rng = np.random.default_rng(orientation)
    img = Image.fromarray(rng.integers(0, 256, (48, 80, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = orientation  # Orientation
    buf = io.BytesIO()
    img.save(buf, format="JPEG", exif=exif.tobytes(), quality=95)
    return buf.getvalue()


@pytest.mark.parametrize("orientation", [6, 3, 8])
def test_exif_orientation_equals_transformers_load_image(orientation, tmp_path):
    """Path and base64 both go through transformers' load_image (it applies exif_transpose); ours
    decodes a path and bytes, which is what a data URL becomes."""
    import base64

    from transformers.image_utils import load_image

    data = _jpeg_with_orientation(orientation)
    path = tmp_path / "photo.jpg"
    path.write_bytes(data)
    lo, hi = 4096, 65536
    for ours_src, hf_src in ((path, str(path)), (data, "data:image/jpeg;base64," + base64.b64encode(data).decode())):
        upright = open_image(ours_src)
        hf_img = load_image(hf_src)
        assert upright.size == hf_img.size
        assert np.array_equal(np.asarray(upright), np.asarray(hf_img))
        ours, grid = image_patches(upright, P, TP, M, lo, hi, MEAN, STD)
        hf = _hf(hf_img, lo, hi)
        assert hf["image_grid_thw"][0].tolist() == grid.tolist()
        torch.testing.assert_close(ours, hf["pixel_values"], rtol=0, atol=1e-6)
    if orientation in (6, 8):  # stored 48 x 80, seen 80 high x 48 wide
        assert upright.size == (48, 80)
