"""Videos through the model against transformers' Qwen3.5 on tiny random weights: the vision
encoder on t > 1 grids (per-frame attention, positions repeated per frame), the features of an
image and a video scattered at their own placeholders, MRoPE from ``get_rope_index`` with
``video_grid_thw``, and the logits."""

from __future__ import annotations

import pytest
import torch

from helpers.hf_fixtures import make_hf_checkpoint  # tests/ is on sys.path (conftest)
from models.qwen35_vl.mrope import mrope_position_ids, split_video_grids
from models.common.vision_patches import patchify, patchify_frames


def _inputs(m, g: torch.Generator):
    """text, an image, text, a 5-frame video (3 temporal groups, timestamps as text), text."""
    v = m.vision
    text = lambda n: torch.randint(0, 400, (n,), generator=g).tolist()  # noqa: E731
    img, img_grid = patchify(torch.rand(3, 64, 32, generator=g), v.patch_size, v.temporal_patch_size,
                             v.spatial_merge_size)
    vid, vid_grid = patchify_frames(torch.rand(5, 3, 32, 64, generator=g), v.patch_size, v.temporal_patch_size,
                                    v.spatial_merge_size)
    merge2 = v.spatial_merge_size**2
    ids = text(4) + [m.vision_start_token_id] + [m.image_token_id] * (int(img_grid.prod()) // merge2)
    ids += [m.vision_end_token_id] + text(3) + [m.vision_start_token_id]
    for _ in range(int(vid_grid[0])):
        ids += text(3) + [m.vision_start_token_id] + [m.video_token_id] * (int(vid_grid[1:].prod()) // merge2)
        ids += [m.vision_end_token_id]
    ids += [m.vision_end_token_id] + text(6)
    types = [1 if t == m.image_token_id else 2 if t == m.video_token_id else 0 for t in ids]
    return torch.tensor([ids]), torch.tensor([types]), img, img_grid[None], vid, vid_grid[None]


def test_video_through_the_model_equals_transformers(tmp_path, mcore):
    from transformers import AutoModelForImageTextToText

    from models.qwen35_vl.parity import build_from_hf, use_hf_torch_kernels

    from core.seeding import seed_everything

    use_hf_torch_kernels()
    seed_everything(0)  # also megatron's model-parallel RNG, which building the layers reads
    hf_dir = make_hf_checkpoint(tmp_path / "hf", vision_depth=2)
    ours, m = build_from_hf(hf_dir, torch.float32)
    hf = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    ours.eval()
    assert m.video_token_id == hf.config.video_token_id
    input_ids, types, img, img_grid, vid, vid_grid = _inputs(m, torch.Generator().manual_seed(0))
    assert vid_grid[0, 0] == 3  # t > 1, the odd last frame repeated

    with torch.no_grad():
        # the encoder alone on a video grid: per-frame attention and positions, as HF
        hf_feats = hf.model.visual(vid, grid_thw=vid_grid).pooler_output
        torch.testing.assert_close(ours.vision_model(vid, vid_grid), hf_feats, atol=1e-5, rtol=1e-4)

        pos = mrope_position_ids(input_ids[0], torch.cat([img_grid, split_video_grids(vid_grid)]), m.vision_token_ids,
                                 m.vision.spatial_merge_size)
        hf_pos, _ = hf.model.get_rope_index(input_ids, types, image_grid_thw=img_grid, video_grid_thw=vid_grid)
        assert torch.equal(pos, hf_pos[:, 0])

        out = hf(input_ids=input_ids, pixel_values=img, image_grid_thw=img_grid, pixel_values_videos=vid,
                 video_grid_thw=vid_grid, mm_token_type_ids=types)
        # ours: one encoder call over the image and the video in sequence order
        logits = ours(input_ids, pos[:, None], pixel_values=torch.cat([img, vid]),
                      image_grid_thw=torch.cat([img_grid, vid_grid]))
    assert (logits - out.logits).abs().max().item() <= 1e-4


def _write_set(out, n: int, seed: int):
    """n records: a photo (red or blue) and a short clip (a square moving left or right), asked
    about in two turns; the answers depend on what the image and the video show."""
    import json

    import av
    import numpy as np
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        colour, right = rng.integers(0, 2), rng.integers(0, 2)
        photo = np.zeros((32, 48, 3), np.uint8)
        photo[..., 0 if colour else 2] = 220
        Image.fromarray(photo).save(out / f"{i}.png")
        with av.open(str(out / f"{i}.mp4"), "w", format="mp4") as c:
            s = c.add_stream("mpeg4", rate=4)
            s.width, s.height, s.pix_fmt = 64, 64, "yuv420p"
            for k in range(8):
                a = np.zeros((64, 64, 3), np.uint8)
                x = 4 + 6 * k if right else 44 - 6 * k
                a[20:36, x:x + 16] = 255
                for p in s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                    c.mux(p)
            for p in s.encode():
                c.mux(p)
        records.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": f"{i}.png"}, {"type": "text", "text": "Colour?"}]},
            {"role": "assistant", "content": "Red." if colour else "Blue."},
            {"role": "user", "content": [{"type": "video", "video": f"{i}.mp4"}, {"type": "text", "text": "Where to?"}]},
            {"role": "assistant", "content": "The square moves right." if right else "The square moves left."}]})
    path = out / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.slow
def test_proxy_trains_on_images_and_a_short_video(tmp_path):
    """pretrain_multimodal.py on the proxy with conversations of an image and a video: the
    validation loss on held-out records falls."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from data.tiny_tokenizer import build_tiny_tokenizer

    root = Path(__file__).resolve().parents[1]
    build_tiny_tokenizer(tmp_path / "tok")
    train, valid = _write_set(tmp_path / "train", 24, seed=0), _write_set(tmp_path / "valid", 6, seed=1)
    env = {**os.environ, "PYTHONPATH": str(root)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, "pretrain_multimodal.py", "--config", "configs/qwen35_vl_proxy.yaml",
         "data.name=conversations", f"data.path={train}", f"data.valid_path={valid}",
         f"data.tokenizer={tmp_path / 'tok'}", "data.min_pixels=1024", "data.max_pixels=16384",
         "data.video.max_pixels=16384", "train.seq_length=256", "train.iters=6",
         "train.eval_interval=3", "train.eval_iters=2", "checkpoint.dir=null", f"logging.dir={tmp_path / 'log'}",
         "logging.progress_bar=false"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0], rows
