"""Videos -> vision-encoder inputs as transformers' Qwen3-VL video processor (which Qwen3.5 ships)
makes them, and the timestamps its processor writes into the prompt.

- Sampling (``sample_indices``): ``int(frames / native_fps * fps)`` frames, clamped to
  [min_frames, max_frames] and to the frames there are, spread evenly over the clip
  (``linspace(0, frames - 1, n)``, rounded).
- Resize (``video_smart_resize``): one size for all frames, sides multiples of patch*merge, with
  ``frames * h * w`` (the whole video's pixels) inside [min_pixels, max_pixels]: the per-video budget.
  Bicubic with antialiasing on the uint8 frames, rounded back to uint8 (torchvision's resize).
- Patches (``patchify_frames``): frames in temporal groups of ``temporal_patch_size`` (2), an odd
  count padded by repeating the last frame, so ``grid_t = ceil(frames / 2)`` (t > 1 grids).
- Prompt (``frame_timestamps``): one ``<{t:.1f} seconds>`` per temporal group, the mean time of
  its first and last frame (``index / native_fps``).

A video is a file (decoded with PyAV, ``av`` on PyPI, the reader qwen-vl-utils uses too) or a
list of frames taken as given at ``fps`` frames per second. tests/test_video.py compares all of
it with transformers.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from models.common.vision_patches import IMAGE_MEAN, IMAGE_STD, patchify_frames

# The released Qwen3.5 checkpoints' video_preprocessor_config.json: fps 2, 4..768 frames, and
# "size": {"shortest_edge": 4096, "longest_edge": 25165824}, the pixel area of a whole video.
CHECKPOINT_VIDEO_FPS = 2.0
CHECKPOINT_VIDEO_MIN_FRAMES = 4
CHECKPOINT_VIDEO_MAX_FRAMES = 768
CHECKPOINT_VIDEO_MIN_PIXELS = 4096
CHECKPOINT_VIDEO_MAX_PIXELS = 25_165_824


def sample_indices(total: int, native_fps: float, fps: float, min_frames: int, max_frames: int) -> np.ndarray:
    """Which of a clip's ``total`` frames to keep when sampling ``fps`` frames a second."""
    n = int(total / native_fps * fps)
    n = min(max(n, min_frames), max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(int)


def frame_timestamps(indices, native_fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal group: the mean of its first and last frame's time (the short last
    group repeats the last frame, as its pixels do)."""
    idx = [int(i) for i in indices]
    idx += idx[-1:] * (-len(idx) % temporal_patch_size)
    t = [i / native_fps for i in idx]
    k = temporal_patch_size
    return [(t[i] + t[i + k - 1]) / 2 for i in range(0, len(t), k)]


def video_smart_resize(num_frames: int, height: int, width: int, factor: int, temporal_factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's video ``smart_resize``: like the image one, but the area range bounds all frames'
    pixels together (``frames * h * w``), and sides below ``factor`` are first scaled up to it."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio of {height}x{width} is over 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    t = round(num_frames / temporal_factor) * temporal_factor
    if t * h * w > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def resize_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 frames [T, C, H, W] on the CPU -> [T, C, height, width]: bicubic with antialiasing on
    the uint8 values (PyTorch's native uint8 kernel), what torchvision's ``resize`` (HF's video
    processor) runs on the CPU."""
    if frames.shape[-2:] == (height, width):
        return frames
    return torch.nn.functional.interpolate(frames.contiguous(), size=(height, width), mode="bicubic",
                                           align_corners=False, antialias=True)


def video_patches(frames: torch.Tensor, patch_size: int, temporal_patch_size: int, merge: int, min_pixels: int,
                  max_pixels: int, mean=IMAGE_MEAN, std=IMAGE_STD) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 RGB frames [T, 3, H, W] -> (pixel_values [grid_t*gh*gw, 3*tp*p*p], grid_thw (grid_t, gh, gw))."""
    if frames.shape[0] < temporal_patch_size:  # as HF: a video needs at least one full temporal patch
        raise ValueError(f"a video needs at least {temporal_patch_size} frames, got {frames.shape[0]}")
    h, w = video_smart_resize(frames.shape[0], frames.shape[-2], frames.shape[-1], patch_size * merge,
                              temporal_patch_size, min_pixels, max_pixels)
    x = resize_frames(frames, h, w).float()
    # rescale and normalise in one step on 0..255 values, as HF does (bit-identical pixels)
    scale = 1 / (1 / 255)
    mean_t = torch.tensor(list(mean), dtype=torch.float32) * scale
    std_t = torch.tensor(list(std), dtype=torch.float32) * scale
    return patchify_frames(x, patch_size, temporal_patch_size, merge, mean_t, std_t)


def decode_video(source, fps: float, min_frames: int, max_frames: int) -> tuple[torch.Tensor, np.ndarray, float]:
    """A video file (path or bytes) -> (sampled uint8 RGB frames [T, 3, H, W], their indices in the
    clip, the clip's frame rate). Raises on anything PyAV cannot decode."""
    import io

    import av

    def frames_of(container):
        stream = container.streams.video[0]
        return stream, container.decode(stream)

    with av.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else str(source)) as container:
        stream, decoded = frames_of(container)
        native_fps = float(stream.average_rate or stream.guessed_rate or 0)
        total = stream.frames
        if not total:  # the container does not say: count by decoding (only the count is kept)
            total = sum(1 for _ in decoded)
    if total <= 0 or native_fps <= 0:
        raise ValueError(f"no frames or no frame rate in the video stream (frames={total}, fps={native_fps})")
    indices = sample_indices(total, native_fps, fps, min_frames, max_frames)
    wanted, kept = set(indices.tolist()), {}
    with av.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else str(source)) as container:
        for i, frame in enumerate(frames_of(container)[1]):
            if i in wanted:
                kept[i] = torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1)
            if i >= indices[-1]:
                break
    if len(kept) != len(wanted):  # the header promised more frames than the stream holds
        raise ValueError(f"the stream has fewer frames than its header's {total}")
    return torch.stack([kept[i] for i in indices.tolist()]), indices, native_fps
