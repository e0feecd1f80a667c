"""What a Qwen3.5-VL checkpoint folder's processor files say about the data
(``ModelFamily.processor_settings``): preprocessor_config.json (image normalisation, pixel range,
patching) and video_preprocessor_config.json (frame rate, frame range, per-video pixel budget).

The result is in the recipe's ``data`` keys; the trainer fills those a recipe left at their
defaults. Plain JSON reading, no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.errors import ConfigError


def processor_settings(folder: str | Path, vision) -> dict[str, Any]:
    """{dotted ``data`` key: value} from the processor files in ``folder`` (either may be absent).
    Raises ConfigError when the image file patches differently from ``vision`` (the model's
    vision section): the pixels would reach the encoder cut wrong, without an error."""
    found: dict[str, Any] = {}
    image_file = Path(folder) / "preprocessor_config.json"
    if image_file.is_file():
        found.update(_image_settings(image_file, vision))
    video_file = Path(folder) / "video_preprocessor_config.json"
    if video_file.is_file():
        found.update(_video_settings(video_file))
    return found


def _image_settings(path: Path, vision) -> dict[str, Any]:
    pre = json.loads(path.read_text())
    pre = pre.get("image_processor", pre)  # some checkpoints nest it
    for key, ours in (("patch_size", vision.patch_size), ("temporal_patch_size", vision.temporal_patch_size),
                      ("merge_size", vision.spatial_merge_size)):
        if key in pre and int(pre[key]) != ours:
            raise ConfigError(f"{path} has {key}={pre[key]} but the model's vision config has {ours}; "
                              "point data.tokenizer at the matching checkpoint or fix model.vision")
    found: dict[str, Any] = {key: [float(x) for x in pre[key]] for key in ("image_mean", "image_std") if key in pre}
    # the pixel range: Qwen3-VL/3.5 files name it size.shortest_edge/longest_edge (areas, not
    # sides), Qwen2-VL files min_pixels/max_pixels
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    for key, names in (("min_pixels", ("shortest_edge", "min_pixels")), ("max_pixels", ("longest_edge", "max_pixels"))):
        values = [size[n] for n in names if n in size] + ([pre[key]] if key in pre else [])
        if values:
            found[key] = int(values[0])
    return found


def _video_settings(path: Path) -> dict[str, Any]:
    pre = json.loads(path.read_text())
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    found = {"video.fps": pre.get("fps"), "video.min_frames": pre.get("min_frames"),
             "video.max_frames": pre.get("max_frames"), "video.min_pixels": size.get("shortest_edge"),
             "video.max_pixels": size.get("longest_edge")}
    return {key: (float(v) if key == "video.fps" else int(v)) for key, v in found.items() if v is not None}
