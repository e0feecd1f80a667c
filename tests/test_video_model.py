"""Videos through the model against transformers' Qwen3.5 on tiny random weights: the vision
encoder on t > 1 grids (per-frame attention, positions repeated per frame), the features of an
image and a video scattered at their own placeholders, MRoPE from ``get_rope_index`` with
``video_grid_thw``, and the logits."""

from __future__ import annotations

import torch

from hf_fixtures import make_hf_checkpoint  # tests/ is on sys.path (conftest)
from models.qwen35_vl.mrope import mrope_position_ids, split_video_grids
from models.qwen35_vl.vision_patches import patchify, patchify_frames


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
