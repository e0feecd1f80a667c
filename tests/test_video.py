"""Video parts of conversations against transformers: frames sampled, resized, normalised and
patched as Qwen3-VL's video processor (Qwen3.5's) does, the prompt's ids equal the real Qwen3.5
template + the processor's expansion (timestamps per temporal group), MRoPE ids equal
``get_rope_index`` with ``video_grid_thw``, and bad videos are skipped and counted."""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data.chat import special_token_ids
from data.tiny_tokenizer import build_tiny_tokenizer
from data.video import decode_video, frame_timestamps, video_patches
from models.qwen35_vl.config import ModelConfig
from data.config import DataConfig, VideoConfig

av = pytest.importorskip("av")
pytest.importorskip("torchvision")  # transformers' video processor resizes with it

TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen35_chat_template.jinja").read_text()
P, TP, M = 16, 2, 2
BUDGET = dict(min_pixels=4096, max_pixels=60_000)  # a few hundred video tokens at most


def make_video(n: int = 9, h: int = 60, w: int = 84, fps: int = 4, seed: int = 0) -> bytes:
    """An MPEG-4 clip of a square moving right over noise, n frames at fps."""
    rng = np.random.default_rng(seed)
    bg = rng.integers(0, 120, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for i in range(n):
            a = bg.copy()
            x = (5 + 6 * i) % (w - 20)
            a[10:30, x:x + 20] = (255, 40 + 20 * seed, 40)
            for p in s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def all_frames(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def hf_video_processor(max_pixels: int, fps: float = 2.0, min_frames: int = 4):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor(size={"shortest_edge": 4096, "longest_edge": max_pixels}, fps=fps,
                                 min_frames=min_frames, max_frames=768, patch_size=P, temporal_patch_size=TP,
                                 merge_size=M, image_mean=[0.5] * 3, image_std=[0.5] * 3, cap_pixels_per_frame=False)


def metadata(frames: np.ndarray, fps: float, indices=None):
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(total_num_frames=len(frames), fps=fps, height=frames.shape[1], width=frames.shape[2],
                         duration=len(frames) / fps, frames_indices=indices)


@pytest.mark.parametrize("n,max_pixels", [(9, 60_000), (13, 25_165_824), (5, 20_000)])
def test_sampled_frames_and_pixels_equal_transformers(n, max_pixels):
    """A file sampled at 2 fps from 4 fps: same frames, same timestamps, bit-identical patches, t > 1 grids."""
    data = make_video(n=n)
    frames = all_frames(data)
    hf = hf_video_processor(max_pixels)(videos=[frames], video_metadata=[metadata(frames, 4.0)], do_sample_frames=True,
                                        return_metadata=True, return_tensors="pt")
    video, indices, fps = decode_video(data, 2.0, 4, 768)
    assert indices.tolist() == hf["video_metadata"][0].frames_indices.tolist()
    pv, grid = video_patches(video, P, TP, M, 4096, max_pixels)
    assert grid.tolist() == hf["video_grid_thw"][0].tolist() and grid[0] > 1
    assert torch.equal(pv, hf["pixel_values_videos"])
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    want = Qwen3VLProcessor._calculate_timestamps(None, indices, fps, TP)
    assert frame_timestamps(indices, fps, TP) == want


def test_odd_frame_list_pads_the_last_group_as_transformers():
    frames = all_frames(make_video(n=7))
    hf = hf_video_processor(60_000)(videos=[frames], do_sample_frames=False, return_tensors="pt")
    pv, grid = video_patches(torch.from_numpy(frames).permute(0, 3, 1, 2), P, TP, M, 4096, 60_000)
    assert grid.tolist() == hf["video_grid_thw"][0].tolist() == [4, grid[1], grid[2]]
    assert torch.equal(pv, hf["pixel_values_videos"])


# ---------------------------------------------------------------- prompt ids and MRoPE


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok35")
    build_tiny_tokenizer(out, chat_template=TEMPLATE)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


def _png(seed: int, h: int = 48, w: int = 80) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_video_set(out: Path) -> list[dict]:
    """Records: video only; image + video over two turns; a video given as a list of frames."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "clip.mp4").write_bytes(make_video(n=9, seed=0))
    (out / "clip2.mp4").write_bytes(make_video(n=11, h=48, w=64, seed=1))
    (out / "photo.png").write_bytes(_png(3))
    frames = all_frames(make_video(n=6, seed=2))
    from PIL import Image

    for k, f in enumerate(frames):
        Image.fromarray(f).save(out / f"frame{k}.png")
    return [
        {"messages": [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"},
                                                   {"type": "text", "text": "Where does the square go?"}]},
                      {"role": "assistant", "content": "It moves right."}]},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "image", "image": "photo.png"},
                                                   {"type": "text", "text": "What is this?"}]},
                      {"role": "assistant", "content": "Noise."},
                      {"role": "user", "content": [{"type": "text", "text": "And this clip?\n"},
                                                   {"type": "video", "video": "clip2.mp4"}]},
                      {"role": "assistant", "content": "A square moving right."}]},
        {"messages": [{"role": "user", "content": [{"type": "video", "video": [f"frame{k}.png" for k in range(6)]},
                                                   {"type": "text", "text": "Describe."}]},
                      {"role": "assistant", "content": "A square."}]},
    ]


def dataset(path: Path, tok, **overrides):
    from data.conversations import ConversationsDataset

    d = DataConfig(name="conversations", path=str(path), min_pixels=1024, max_pixels=16384,
                   video=VideoConfig(**{**BUDGET, **overrides}))
    return ConversationsDataset(ModelConfig(vocab_size=512, **special_token_ids(tok)), d, 4096, tok)


def hf_processor(tok):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    images = Qwen2VLImageProcessorPil(patch_size=P, temporal_patch_size=TP, merge_size=M, image_mean=[0.5] * 3,
                                      image_std=[0.5] * 3, min_pixels=1024, max_pixels=16384)
    return Qwen3VLProcessor(image_processor=images, tokenizer=tok,
                            video_processor=hf_video_processor(BUDGET["max_pixels"]), chat_template=TEMPLATE)


def hf_inputs(processor, record: dict, root: Path):
    """transformers' reference: the template's text, then the processor's expansion and patches."""
    from PIL import Image

    images, videos, metas = [], [], []
    for msg in record["messages"]:
        for part in msg["content"] if isinstance(msg["content"], list) else []:
            if part["type"] == "image":
                images.append(Image.open(root / part["image"]).convert("RGB"))
            elif part["type"] == "video" and isinstance(part["video"], list):  # frames at 2 fps, no sampling
                frames = np.stack([np.asarray(Image.open(root / f).convert("RGB")) for f in part["video"]])
                videos.append(frames)
                metas.append(metadata(frames, 2.0, np.arange(len(frames))))
            elif part["type"] == "video":  # sampled by the video processor's own sample_frames
                frames = all_frames((root / part["video"]).read_bytes())
                with av.open(str(root / part["video"])) as c:
                    native = float(c.streams.video[0].average_rate)
                idx = processor.video_processor.sample_frames(metadata(frames, native))
                videos.append(frames[idx])
                metas.append(metadata(frames, native, idx))
    text = processor.apply_chat_template(record["messages"], tokenize=False)
    return processor(text=[text], images=images or None, videos=videos or None,
                     video_metadata=metas or None, do_sample_frames=False, return_tensors="pt")


def hf_rope_index(out, merge: int):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    fake = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge)),
                           get_vision_position_ids=lambda *a, **k: Qwen3_5Model.get_vision_position_ids(None, *a, **k))
    pos, _ = Qwen3_5Model.get_rope_index(fake, out["input_ids"], out["mm_token_type_ids"],
                                         image_grid_thw=out.get("image_grid_thw"),
                                         video_grid_thw=out.get("video_grid_thw"))
    return pos[:, 0]


def test_ids_pixels_and_mrope_equal_transformers(tmp_path, tok):
    records = write_video_set(tmp_path)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    ds, processor = dataset(path, tok), hf_processor(tok)
    ids = special_token_ids(tok)
    for i, record in enumerate(records):
        s, ref = ds[i], hf_inputs(processor, record, tmp_path)
        assert s is not None, ds.skipped
        assert s["input_ids"].tolist() == ref["input_ids"][0].tolist(), f"record {i}"
        stamps = re.findall(r"<(\d+\.\d) seconds><\|vision_start\|><\|video_pad\|>", tok.decode(s["input_ids"]))
        assert len(stamps) == int(s["video_grid_thw"][:, 0].sum())  # one timestamp per temporal group
        assert torch.equal(s["video_grid_thw"], ref["video_grid_thw"])
        assert (s["video_grid_thw"][:, 0] > 1).all()
        hf_pixels = [ref["pixel_values"]] if "pixel_values" in ref else []
        assert torch.equal(s["pixel_values"], torch.cat(hf_pixels + [ref["pixel_values_videos"]]))  # image first
        assert torch.equal(s["position_ids"], hf_rope_index(ref, M)), f"record {i}"
        # only the answers (and their <|im_end|>) are supervised
        sup = [s["input_ids"][t + 1].item() for t in s["loss_mask"].nonzero().flatten().tolist()]
        answers = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        want = sum((tok.encode(a, add_special_tokens=False) + [ids["im_end_token_id"]] for a in answers), [])
        assert sup == want


def test_collate_and_inspect_carry_video_grids(tmp_path, tok, tok_dir, capsys):
    from data.collate import pack_thd, pad_bshd
    from multimodal.inspect_data import main as inspect_main

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in write_video_set(tmp_path)))
    ds = dataset(path, tok)
    samples = [ds[0], ds[1]]
    vision_ids = ModelConfig(**special_token_ids(tok)).vision_token_ids
    n = sum(len(s["input_ids"]) for s in samples)
    for batch in (pack_thd(samples, n + 8, 0, vision_ids, M), pad_bshd(samples, n, 0, vision_ids, M)):
        assert batch["image_grid_thw"].tolist() == [g for s in samples for g in s["image_grid_thw"].tolist()]
        assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(1).sum())
    with pytest.raises(ValueError, match="image tokens but its image_grid_thw"):  # a video token too many
        bad = dict(samples[0], input_ids=torch.cat([samples[0]["input_ids"], torch.tensor([vision_ids[1]])]))
        pack_thd([bad], n + 8, 0, vision_ids, M)
    rc = inspect_main(["--config", "configs/qwen35_vl_proxy_cord.yaml", "--num", "2", "--json",
                       "data.name=conversations", f"data.path={path}", f"data.tokenizer={tok_dir}",
                       "data.max_pixels=16384", "data.video.max_pixels=60000"])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["video_grid_thw"] for r in rows] == [s["video_grid_thw"].tolist() for s in samples]


def test_bad_videos_are_skipped_counted_and_logged(tmp_path, tok, caplog):
    (tmp_path / "broken.mp4").write_bytes(b"not a video at all")
    (tmp_path / "one.png").write_bytes(_png(1))
    ask = lambda v: {"messages": [{"role": "user", "content": [{"type": "video", "video": v}]},  # noqa: E731
                                  {"role": "assistant", "content": "ok"}]}
    records = [ask("missing.mp4"), ask("broken.mp4"), ask(["one.png"]), ask(None)]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    ds = dataset(path, tok)
    with caplog.at_level(logging.WARNING):
        assert [ds[i] for i in range(len(records))] == [None] * len(records)
    assert dict(ds.skipped) == {"missing_video": 2, "bad_video": 2}
    assert "record 1 skipped (bad_video)" in caplog.text and "needs at least 2 frames" in caplog.text


def test_context_parallel_routes_video_features_to_their_tokens(tmp_path, tok):
    """Under CP every rank finds, for each of its image and video tokens, its row of the features of
    all images and videos (in sequence order); with cp_split_vision a video is encoded whole by one rank."""
    from data.collate import pack_thd
    from multimodal.context_parallel import partition_batch

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in write_video_set(tmp_path)))
    ds = dataset(path, tok)
    vision_ids = ModelConfig(**special_token_ids(tok)).vision_token_ids
    seq = 8 * -(-sum(len(ds[i]["input_ids"]) + 8 for i in range(3)) // 8)
    b = pack_thd([ds[i] for i in range(3)], seq, 0, vision_ids, M, pad_multiple=8)
    is_vision = (b["tokens"] == vision_ids[0]) | (b["tokens"] == vision_ids[1])
    full = torch.full(b["tokens"].shape, -1)
    full[is_vision] = torch.arange(int(is_vision.sum()))
    got, encoded = torch.full(b["tokens"].shape, -1), []
    for r in range(4):
        part = partition_batch(b, 4, r, vision_ids, split_vision=True, merge=M)
        local = (part["tokens"] == vision_ids[0]) | (part["tokens"] == vision_ids[1])
        values = torch.full(part["tokens"].shape, -1)
        values[local] = part["image_feature_index"]
        got[:, part["cp_gather_order"][r * (seq // 4):(r + 1) * (seq // 4)]] = values
        encoded += part["vision_images"]
    assert torch.equal(got, full)
    assert sorted(encoded) == list(range(b["image_grid_thw"].shape[0]))


def test_video_settings_come_from_the_checkpoints_video_preprocessor_config(tmp_path):
    """A video_preprocessor_config.json beside the tokenizer sets the data.video_* keys left at their
    defaults; a value given on the command line wins."""
    from multimodal.config import load_config, resolve_sources

    build_tiny_tokenizer(tmp_path)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"fps": 1, "min_frames": 2, "max_frames": 64, "size": {"shortest_edge": 8192, "longest_edge": 1_000_000},
         "video_processor_type": "Qwen3VLVideoProcessor"}))
    d = resolve_sources(load_config(None, [f"data.tokenizer={tmp_path}", "data.video.max_frames=32"])).data
    v = d.video
    assert (v.fps, v.min_frames, v.max_frames, v.min_pixels, v.max_pixels) == \
           (1.0, 2, 32, 8192, 1_000_000)


def test_sharegpt_video_tags_equal_the_chat_form(tmp_path, tok, caplog):
    """``<video>`` tags take the record's ``video``/``videos`` in order, like ``<image>`` its images."""
    chat = write_video_set(tmp_path)[1]
    share = {"system": "Be brief.", "image": "photo.png", "videos": ["clip2.mp4"], "conversations": [
        {"from": "human", "value": "<image>What is this?"}, {"from": "gpt", "value": "Noise."},
        {"from": "human", "value": "And this clip?\n<video>"}, {"from": "gpt", "value": "A square moving right."}]}
    extra = dict(share, conversations=share["conversations"][:2])  # a video without its tag
    path = tmp_path / "both.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (chat, share, extra)))
    ds = dataset(path, tok)
    a, b = ds[0], ds[1]
    for key in ("input_ids", "loss_mask", "position_ids", "pixel_values", "image_grid_thw", "video_grid_thw"):
        assert torch.equal(a[key], b[key]), key
    with caplog.at_level(logging.WARNING):
        assert ds[2] is None
    assert dict(ds.skipped) == {"video_count_mismatch": 1} and "0 <video> tag(s) but 1 video(s)" in caplog.text
