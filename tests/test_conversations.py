"""data.name=conversations: both record forms from JSON and JSONL, images by path or embedded,
system prompts, bad records skipped and counted, config errors, and a proxy run on a synthetic set."""

from __future__ import annotations

import base64
import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from data.chat import encode_conversation, special_token_ids
from data.record_sources import JsonlRecords
from data.tiny_tokenizer import build_tiny_tokenizer
from models.qwen35_vl.config import ModelConfig
from data.config import ConversationsConfig, DataConfig

SEQ = 1024
PIXELS = dict(min_pixels=1024, max_pixels=16384)  # small images keep each test at a second or two


def _png(seed: int, h: int = 48, w: int = 80) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_synthetic_conversations(out: Path, n: int = 8) -> list[dict]:
    """n good records (alternating forms, 0-2 images, some multi-turn) and their images under out/images."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        imgs = [f"images/{i}_{k}.png" for k in range(i % 3)]
        for k, rel in enumerate(imgs):
            (out / rel).write_bytes(_png(10 * i + k))
        answer = f"Item {i} costs {1000 * (i + 1):,}."
        if i % 2:  # LLaVA/ShareGPT form
            records.append({"image": imgs, "conversations": [
                {"from": "human", "value": "".join("<image>\n" for _ in imgs) + "What does this receipt say?"},
                {"from": "gpt", "value": answer}]})
        else:
            parts = [{"type": "image", "image": rel} for rel in imgs] + [{"type": "text", "text": "What does it say?"}]
            turns = [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]
            if i % 4 == 0:
                turns += [{"role": "user", "content": "And the total?"}, {"role": "assistant", "content": "48,000"}]
            records.append({"messages": turns})
    return records


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


@pytest.fixture(scope="module")
def model_cfg(tok):
    return ModelConfig(vocab_size=512, **special_token_ids(tok))


def _ds(path, model_cfg, tok, **data):
    from data.conversations import ConversationsDataset

    cfg = DataConfig(name="conversations", path=str(path), **{**PIXELS, **data})
    return ConversationsDataset(model_cfg, cfg, SEQ, tok)


def test_both_forms_from_jsonl_and_json(tmp_path, model_cfg, tok):
    records = write_synthetic_conversations(tmp_path)
    ds = _ds(_jsonl(tmp_path / "train.jsonl", records), model_cfg, tok)
    as_list = tmp_path / "train.json"
    as_list.write_text(json.dumps(records))
    ds_json = _ds(as_list, model_cfg, tok)
    assert len(ds) == len(ds_json) == len(records) and isinstance(ds.records, JsonlRecords)  # offsets only
    ids = special_token_ids(tok)
    for i in range(len(records)):
        s, t = ds[i], ds_json[i]
        assert torch.equal(s["input_ids"], t["input_ids"]) and torch.equal(s["pixel_values"], t["pixel_values"])
        n_img = i % 3
        assert s["image_grid_thw"].shape == (n_img, 3) and s["pixel_values"].shape[0] == int(s["image_grid_thw"].prod(1).sum())
        assert int((s["input_ids"] == ids["image_token_id"]).sum()) == int(s["image_grid_thw"].prod(1).sum()) // 4
        assert torch.equal(s["labels"][:-1], s["input_ids"][1:]) and s["position_ids"].shape == (3, len(s["input_ids"]))
        supervised = tok.decode(s["labels"][s["loss_mask"].bool()].tolist())
        answer = f"Item {i} costs {1000 * (i + 1):,}.<|im_end|>"
        assert supervised == answer + ("48,000<|im_end|>" if i % 4 == 0 else "")
    assert not ds.skipped


def _same_samples(a, b):
    assert len(a) == len(b)
    for i in range(len(a)):
        for key in ("input_ids", "loss_mask", "position_ids", "pixel_values", "image_grid_thw"):
            assert torch.equal(a[i][key], b[i][key]), (i, key)


def test_datasets_folders_read_as_the_jsonl(tmp_path, model_cfg, tok):
    """Folders that Hugging Face datasets writes (save_to_disk: arrow; to_parquet) hold the same
    samples as the JSONL of the same records: the chat form with image paths, the LLaVA form with
    a datasets Image column (embedded bytes); a DatasetDict folder is refused naming its splits."""
    import datasets

    records = write_synthetic_conversations(tmp_path)
    chat = [r for r in records if "messages" in r]
    for r in chat:  # one arrow type per column: every content as a list of parts
        for m in r["messages"]:
            if isinstance(m["content"], str):
                m["content"] = [{"type": "text", "text": m["content"]}]
    share = [r for r in records if "conversations" in r]
    chat_dir, share_dir, parquet_dir = tmp_path / "chat_ds", tmp_path / "share_ds", tmp_path / "share_parquet"
    datasets.Dataset.from_list(chat).save_to_disk(str(chat_dir))
    images = datasets.Sequence(datasets.Image())
    share_ds = datasets.Dataset.from_list(
        [{**r, "image": [{"bytes": (tmp_path / p).read_bytes(), "path": None} for p in r["image"]]} for r in share],
        features=datasets.Features({"image": images, "conversations": datasets.List(
            {"from": datasets.Value("string"), "value": datasets.Value("string")})}))
    share_ds.save_to_disk(str(share_dir))
    parquet_dir.mkdir()
    share_ds.to_parquet(str(parquet_dir / "train-00000.parquet"))

    _same_samples(_ds(chat_dir, model_cfg, tok, conversations=ConversationsConfig(image_root=str(tmp_path))),
                  _ds(_jsonl(tmp_path / "chat.jsonl", chat), model_cfg, tok))
    share_jsonl = _ds(_jsonl(tmp_path / "share.jsonl", share), model_cfg, tok)
    _same_samples(_ds(share_dir, model_cfg, tok), share_jsonl)
    _same_samples(_ds(parquet_dir, model_cfg, tok), share_jsonl)
    assert sum(int(share_jsonl[i]["image_grid_thw"].shape[0]) for i in range(len(share))) > 0

    datasets.DatasetDict({"train": share_ds, "validation": share_ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"DatasetDict; point at one split: .*dd/train, .*dd/validation"):
        _ds(tmp_path / "dd", model_cfg, tok)


def test_sharegpt_equals_chat_form_and_base64_equals_path(tmp_path, model_cfg, tok):
    (tmp_path / "a.png").write_bytes(_png(1))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.png").write_bytes(_png(2, 64, 40))
    embedded = "data:image/png;base64," + base64.b64encode(_png(2, 64, 40)).decode()
    chat = {"messages": [
        {"role": "system", "content": "You read receipts."},
        {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "\nand\n"},
                                     {"type": "image", "image": embedded}, {"type": "text", "text": "\nCompare."}]},
        {"role": "assistant", "content": "Same total."}]}
    share = {"image": ["a.png", "sub/b.png"], "system": "You read receipts.", "conversations": [
        {"from": "human", "value": "<image>\nand\n<image>\nCompare."}, {"from": "gpt", "value": "Same total."}]}
    ds = _ds(_jsonl(tmp_path / "d.jsonl", [chat, share]), model_cfg, tok)
    a, b = ds[0], ds[1]
    assert a["image_grid_thw"].shape == (2, 3)
    for key in ("input_ids", "loss_mask", "position_ids", "pixel_values", "image_grid_thw"):
        assert torch.equal(a[key], b[key]), key
    # ids are what the chat encoder makes of the same conversation
    msgs = [chat["messages"][0], {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nand\n"},
                                                               {"type": "image"}, {"type": "text", "text": "\nCompare."}]},
            chat["messages"][2]]
    counts = (a["image_grid_thw"].prod(1) // 4).tolist()
    assert a["input_ids"].tolist() == encode_conversation(tok, msgs, counts, special_token_ids(tok))[0]


def test_system_prompt_and_image_root(tmp_path, model_cfg, tok):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "x.png").write_bytes(_png(5))
    rec = {"messages": [{"role": "user", "content": [{"type": "image", "image": "x.png"}, {"type": "text", "text": "Hi"}]},
                        {"role": "assistant", "content": "Hello"}]}
    path = _jsonl(tmp_path / "d.jsonl", [rec])
    assert _ds(path, model_cfg, tok)[0] is None  # x.png is not beside the file
    ds = _ds(path, model_cfg, tok, conversations=ConversationsConfig(image_root=str(tmp_path / "imgs"),
                                                          system_prompt="Be brief."))
    text = tok.decode(ds[0]["input_ids"].tolist())
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n<|vision_start|>")


def test_bad_records_are_skipped_counted_and_logged(tmp_path, model_cfg, tok, caplog):
    (tmp_path / "ok.png").write_bytes(_png(0))
    (tmp_path / "broken.png").write_bytes(b"not a png")
    user = {"role": "user", "content": "Hi"}
    bad = {
        "bad_json": '{"messages": [',
        "bad_record": {"text": "no conversation here"},
        "unknown_role": {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
        "missing_image": {"messages": [{"role": "user", "content": [{"type": "image", "image": "gone.png"}]},
                                       {"role": "assistant", "content": "y"}]},
        "bad_image": {"image": "broken.png", "conversations": [{"from": "human", "value": "<image>"},
                                                               {"from": "gpt", "value": "y"}]},
        "image_count_mismatch": {"image": ["ok.png", "ok.png"], "conversations": [
            {"from": "human", "value": "<image> one tag"}, {"from": "gpt", "value": "y"}]},
        "empty_answer": {"messages": [user, {"role": "assistant", "content": "  \n"}]},
        "too_long": {"messages": [user, {"role": "assistant", "content": "word " * 2000}]},
    }
    good = {"messages": [user, {"role": "assistant", "content": "Hello"}]}
    lines = [good] + list(bad.values()) + ["", good]  # a blank line is not a record
    ds = _ds(_jsonl(tmp_path / "d.jsonl", lines), model_cfg, tok)
    assert len(ds) == len(bad) + 2
    with caplog.at_level(logging.WARNING, logger="data.conversations"):
        got = [ds[i] for i in range(len(ds))]
    assert got[0] is not None and got[-1] is not None and all(s is None for s in got[1:-1])
    assert dict(ds.skipped) == {reason: 1 for reason in bad}
    for i, reason in enumerate(bad, start=1):
        assert f"record {i} skipped ({reason})" in caplog.text


def test_config_names_the_field(tmp_path, tok_dir):
    from multimodal.config import ConfigError, load_config, validate

    with pytest.raises(ConfigError, match="data.path: an existing .json or .jsonl file"):
        validate(load_config(None, ["data.name=conversations", f"data.path={tmp_path / 'none.csv'}",
                                    f"data.tokenizer={tok_dir}"]))
    path = _jsonl(tmp_path / "d.jsonl", [])
    with pytest.raises(ConfigError, match="data.conversations.image_root"):
        validate(load_config(None, ["data.name=conversations", f"data.path={path}", f"data.tokenizer={tok_dir}",
                                    f"data.conversations.image_root={tmp_path / 'nowhere'}"]))
    with pytest.raises(ConfigError, match="needs data.tokenizer"):
        validate(load_config(None, ["data.name=conversations", f"data.path={path}"]))


def test_inspect_json_prints_ids_and_grids(tmp_path, tok_dir, tok, capsys):
    from multimodal.inspect_data import main as inspect_main

    path = _jsonl(tmp_path / "train.jsonl", write_synthetic_conversations(tmp_path, n=3))
    rc = inspect_main(["--config", "configs/qwen35_vl_proxy_cord.yaml", "--num", "3", "--json", "data.name=conversations",
                       f"data.path={path}", f"data.tokenizer={tok_dir}", "data.max_pixels=16384"])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2] and [len(r["image_grid_thw"]) for r in rows] == [0, 1, 2]
    for r in rows:
        assert len(r["input_ids"]) == r["num_tokens"] and tok.decode(r["input_ids"]).startswith("<|im_start|>user\n")


def test_inspect_json_gives_what_transformers_gives(tmp_path, tok_dir, tok, capsys):
    """--json's ids, loss mask, MRoPE ids and pixel statistics against transformers'
    Qwen3VLProcessor (Qwen's template) and Qwen3.5's get_rope_index on the same records."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    from multimodal.config import load_config, resolve_sources
    from multimodal.inspect_data import main as inspect_main
    from test_video import TEMPLATE, hf_rope_index, hf_video_processor

    (tmp_path / "images").mkdir()
    for k, (h, w) in enumerate([(48, 80), (120, 40)]):
        (tmp_path / "images" / f"{k}.png").write_bytes(_png(k, h, w))
    records = [{"messages": [
        {"role": "user", "content": [{"type": "image", "image": "images/0.png"}, {"type": "text", "text": "Total?"}]},
        {"role": "assistant", "content": "48,000"},
        {"role": "user", "content": [{"type": "image", "image": "images/1.png"}, {"type": "text", "text": "And this?"}]},
        {"role": "assistant", "content": "9,500 in cash."}]}]
    args = ["data.name=conversations", f"data.path={_jsonl(tmp_path / 'train.jsonl', records)}",
            f"data.tokenizer={tok_dir}", "data.max_pixels=16384"]
    assert inspect_main(["--config", "configs/qwen35_vl_proxy_cord.yaml", "--num", "1", "--json", *args]) == 0
    row = json.loads(capsys.readouterr().out)
    d = resolve_sources(load_config("configs/qwen35_vl_proxy_cord.yaml", args)).data
    images = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=list(d.image_mean),
                                      image_std=list(d.image_std), min_pixels=d.min_pixels, max_pixels=d.max_pixels)
    processor = Qwen3VLProcessor(image_processor=images, tokenizer=tok, video_processor=hf_video_processor(4096),
                                 chat_template=TEMPLATE)
    from PIL import Image

    pils = [Image.open(tmp_path / "images" / f"{k}.png").convert("RGB") for k in range(2)]
    ref = processor(text=[processor.apply_chat_template(records[0]["messages"], tokenize=False)], images=pils,
                    return_tensors="pt")
    assert row["input_ids"] == ref["input_ids"][0].tolist()
    assert row["position_ids"] == hf_rope_index(ref, 2).tolist()
    # the loss mask is shifted: position t trains the prediction of token t + 1
    sup = [row["input_ids"][t + 1] for t, m in enumerate(row["loss_mask"]) if m]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert sup == tok.encode("48,000", add_special_tokens=False) + [im_end] + \
        tok.encode("9,500 in cash.", add_special_tokens=False) + [im_end]
    assert len(row["loss_mask"]) == len(row["input_ids"]) and set(row["loss_mask"]) == {0, 1}
    start = 0
    for stats, grid in zip(row["pixel_stats"], ref["image_grid_thw"].tolist(), strict=True):
        n = grid[0] * grid[1] * grid[2]
        x = ref["pixel_values"][start:start + n].double()
        start += n
        assert stats["grid_thw"] == grid and stats["patches"] == n
        for key, want in (("mean", x.mean()), ("std", x.std()), ("min", x.min()), ("max", x.max())):
            assert stats[key] == pytest.approx(want.item(), abs=1e-6), key
        rgb = x.reshape(n, 3, -1).transpose(0, 1).reshape(3, -1).mean(1)  # rows are (channel, t, y, x)
        assert stats["channel_mean"] == pytest.approx(rgb.tolist(), abs=1e-6)


@pytest.mark.slow
def test_proxy_trains_on_synthetic_conversations(tmp_path, tok_dir):
    """pretrain_multimodal.py with data.name=conversations: three steps, finite loss."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    path = _jsonl(tmp_path / "train.jsonl", write_synthetic_conversations(tmp_path, n=12))
    env = {**os.environ, "PYTHONPATH": str(root)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, "pretrain_multimodal.py", "--config", "configs/qwen35_vl_proxy_cord.yaml",
         "data.name=conversations", f"data.path={path}", f"data.tokenizer={tok_dir}", "train.iters=3",
         "checkpoint.dir=null", f"logging.dir={tmp_path / 'log'}", "logging.progress_bar=false",
         "data.max_pixels=16384", "train.seq_length=512"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(0 < r["loss"] < 20 for r in rows)


def test_image_conversations_set_loads_with_every_file_decoded(tmp_path, model_cfg, tok):
    """scripts/make_image_conversations.py's set: each record's own files, JPEG and PNG, decode to
    the grids the image pipeline gives those files, in record order, with their image tokens."""
    from data.image import image_patches, open_image
    from data.synthetic_images import write_image_conversations

    path = write_image_conversations(tmp_path, samples=5, lo=40, hi=200, max_images=3, seed=1, processes=2)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    ds = _ds(path, model_cfg, tok)
    assert len(ds) == 5 and {p.suffix for p in (tmp_path / "images").iterdir()} == {".jpg", ".png"}
    all_grids = set()
    for i, record in enumerate(records):
        files = [part["image"] for part in record["messages"][0]["content"] if part["type"] == "image"]
        assert 1 <= len(files) <= 3
        sample = ds[i]
        grids = [tuple(g) for g in sample["image_grid_thw"].tolist()]
        expected = [tuple(image_patches(open_image(str(tmp_path / rel)), 16, 2, 2, **PIXELS)[1])
                    for rel in files]
        assert grids == expected
        all_grids.update(grids)
        assert int((sample["input_ids"] == model_cfg.image_token_id).sum()) == sum(t * h * w // 4 for t, h, w in grids)
    assert len(all_grids) > 3  # sides vary, so a mix-up of files would change the grids
    assert (tmp_path / "tokenizer" / "tokenizer_config.json").is_file()
