"""CORD-v2 pipeline: tiny Qwen-style tokenizer, exact chat loss masks, the parquet dataset
(targets, image tokens, MRoPE positions, bad rows, truncation), all on data made in tmp dirs."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging

import pytest
import torch

from data.chat import encode_conversation, special_token_ids
from data.collate import pad_bshd
from data.cord_v2 import CordV2Dataset, donut_tokens, smart_resize
from data.tiny_tokenizer import QWEN_SPECIAL_TOKENS, build_tiny_tokenizer
from models.qwen35_vl.mrope import mrope_position_ids
from models.qwen35_vl.config import ModelConfig
from multimodal.config import DataConfig

MERGE = 2
SEQ = 1024


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """Built, saved, and loaded back, so the save_pretrained round trip is what gets tested."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="module")
def ids(tok):
    return special_token_ids(tok)


@pytest.fixture(scope="module")
def model_cfg(ids):
    return ModelConfig(vocab_size=512, **ids)  # ids has exactly ModelConfig's token-id keys


@pytest.fixture(scope="module")
def cord(tmp_path_factory):
    from data.synthetic_cord import write_synthetic_cord

    out = tmp_path_factory.mktemp("cord")
    return out, write_synthetic_cord(out, n_train=6, n_val=2, n_test=2, seed=3, bad_rows=True)


def _ds(cord, model_cfg, tok, seq=SEQ, **kw):
    return CordV2Dataset(model_cfg, dataclasses.replace(DataConfig(), name="cord_v2", path=str(cord[0])), seq, tok, **kw)


def _targets(tok, sample_ids, mask) -> list[str]:
    """Decode each contiguous run of supervised *labels* (ids[t+1] where mask[t] == 1)."""
    runs, cur = [], []
    for t, m in enumerate(mask):
        if m:
            cur.append(int(sample_ids[t + 1]))
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


# ---------------------------------------------------------------- tokenizer + chat


def test_tiny_tokenizer_is_deterministic_and_qwen_like(tok, tmp_path):
    again = build_tiny_tokenizer(tmp_path)
    assert again.get_vocab() == tok.get_vocab()
    assert max(tok.get_vocab().values()) < 500
    assert all(t in tok.get_vocab() for t in QWEN_SPECIAL_TOKENS)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is None
    assert tok.tokenize("x<|image_pad|>y")[1] == "<|image_pad|>"  # specials split out before BPE


def test_piecewise_ids_equal_chat_template(tok, ids):
    msgs = [
        {"role": "system", "content": "You read receipts."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Extract the receipt fields as JSON."}]},
        {"role": "assistant", "content": '{"menu": {"nm": "Latte", "cnt": "1"}}'},
    ]
    rendered = tok.apply_chat_template(msgs, tokenize=False)
    want = tok(rendered, add_special_tokens=False)["input_ids"]
    got, _ = encode_conversation(tok, msgs, [1], ids)
    assert got == want
    got3, _ = encode_conversation(tok, msgs, [3], ids)
    pad = ids["image_token_id"]
    i = want.index(pad)
    assert got3 == want[:i] + [pad] * 3 + want[i + 1:]


def test_single_turn_mask_covers_answer_and_im_end_only(tok, ids):
    answer = '{"total": {"total_price": "9,000"}}'
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Read it."}]},
            {"role": "assistant", "content": answer}]
    seq, mask = encode_conversation(tok, msgs, [4], ids)
    assert len(seq) == len(mask) and mask[-1] == 0.0
    assert _targets(tok, seq, mask) == [answer + "<|im_end|>"]
    supervised = {seq[t + 1] for t, m in enumerate(mask) if m}
    for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id", "im_start_token_id"):
        assert ids[key] not in supervised
    # the last supervised label is the im_end; the newline after it is not trained
    last = max(t for t, m in enumerate(mask) if m)
    assert seq[last + 1] == ids["im_end_token_id"] and last + 1 == len(seq) - 2


def test_multi_turn_every_assistant_turn_supervised(tok, ids):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Total?"}]},
        {"role": "assistant", "content": "48,000"},
        {"role": "user", "content": "And the assistant said what about items?"},
        {"role": "assistant", "content": "2 Latte"},
    ]
    seq, mask = encode_conversation(tok, msgs, [2], ids)
    assert _targets(tok, seq, mask) == ["48,000<|im_end|>", "2 Latte<|im_end|>"]
    assert sum(mask) == len(tok.encode("48,000")) + len(tok.encode("2 Latte")) + 2


def test_image_count_mismatch_raises(tok, ids):
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}]
    with pytest.raises(ValueError, match="1 image token counts given but the conversation has 2"):
        encode_conversation(tok, msgs, [1], ids)
    with pytest.raises(ValueError, match="2 image token counts"):
        encode_conversation(tok, [{"role": "user", "content": "hi"}], [1, 1], ids)


def test_missing_image_token_raises_clearly(tmp_path, cord, model_cfg):
    no_img = build_tiny_tokenizer(tmp_path, special_tokens=[t for t in QWEN_SPECIAL_TOKENS if t != "<|image_pad|>"])
    with pytest.raises(ValueError, match=r"lacks .*<\|image_pad\|>"):
        special_token_ids(no_img)
    with pytest.raises(ValueError, match=r"<\|image_pad\|>"):
        _ds(cord, model_cfg, no_img)


def test_pad_falls_back_to_eos(tok):
    got = special_token_ids(tok)
    assert got["pad_token_id"] == got["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    padded = copy.deepcopy(tok)
    padded.pad_token = "<|endoftext|>"
    assert special_token_ids(padded)["pad_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")
    bare = copy.deepcopy(tok)
    bare.eos_token = None
    with pytest.raises(ValueError, match="neither a pad token nor an eos"):
        special_token_ids(bare)


# ---------------------------------------------------------------- dataset


def test_smart_resize_bounds_and_aspect():
    for h, w in [(300, 150), (37, 1000), (2000, 1500), (20, 20)]:
        rh, rw = smart_resize(h, w, 32, 4 * 1024, 64 * 1024)
        assert rh % 32 == 0 and rw % 32 == 0 and 4 * 1024 <= rh * rw <= 64 * 1024
        assert abs(rh / rw - h / w) / (h / w) < 0.5


def test_samples_match_mock_format(cord, model_cfg, tok, ids):
    ds = _ds(cord, model_cfg, tok, min_pixels=8 * 1024, max_pixels=48 * 1024)
    gts = cord[1]["gt"]["train"]
    assert len(ds) == len(gts) and len(ds.files) == 2
    samples = []
    for i, gt in enumerate(gts):
        if gt is None:
            continue
        s = ds[i]
        samples.append(s)
        n, grid = len(s["input_ids"]), s["image_grid_thw"]
        assert s["index"] == i and s["input_ids"].dtype == torch.long and s["loss_mask"].dtype == torch.float32
        assert torch.equal(s["labels"][:-1], s["input_ids"][1:]) and s["labels"][-1] == -100
        assert grid.shape == (1, 3) and grid[0, 0] == 1
        assert 8 * 1024 <= int(grid[0, 1] * grid[0, 2]) * 16 * 16 <= 48 * 1024
        assert s["pixel_values"].shape == (int(grid.prod()), 3 * 2 * 16 * 16)
        n_img = int((s["input_ids"] == ids["image_token_id"]).sum())
        assert n_img == int(grid.prod()) // MERGE**2
        assert torch.equal(s["position_ids"], mrope_position_ids(s["input_ids"], grid, ids["image_token_id"], MERGE))
        assert s["position_ids"].shape == (3, n) and s["position_ids"][0, -1] < n  # images compress positions
        assert _targets(tok, s["input_ids"], s["loss_mask"]) == [json.dumps(gt, ensure_ascii=False) + "<|im_end|>"]
    batch = pad_bshd(samples, SEQ, ids["pad_token_id"], ids["image_token_id"], MERGE)  # collator accepts them
    assert batch["tokens"].shape == (len(samples), SEQ)
    assert not ds.skipped and ds.truncated == 0


def test_json_target_keeps_key_order(cord, model_cfg, tok):
    ds = _ds(cord, model_cfg, tok)
    for i, gt in enumerate(cord[1]["gt"]["train"]):
        if gt is None:
            continue
        text = _targets(tok, ds[i]["input_ids"], ds[i]["loss_mask"])[0].removesuffix("<|im_end|>")
        parsed = json.loads(text)
        assert parsed == gt and list(parsed) == list(gt)  # "menu", ["sub_total"], "total"
        menu = parsed["menu"] if isinstance(parsed["menu"], list) else [parsed["menu"]]
        assert all(list(item) == ["nm", "cnt", "price"] for item in menu)


def test_donut_target(cord, model_cfg, tok):
    gt = {"menu": [{"nm": "A", "cnt": "1"}, {"nm": "B"}], "total": {"total_price": "5"}}
    assert donut_tokens(gt) == ("<s_menu><s_nm>A</s_nm><s_cnt>1</s_cnt><sep/><s_nm>B</s_nm></s_menu>"
                                "<s_total><s_total_price>5</s_total_price></s_total>")
    ds = _ds(cord, model_cfg, tok, target_format="donut")
    gt0 = cord[1]["gt"]["train"][0]
    s = ds[0]
    assert _targets(tok, s["input_ids"], s["loss_mask"]) == [donut_tokens(gt0) + "<|im_end|>"]
    assert "Donut" in tok.decode(s["input_ids"])  # the donut prompt, not the JSON one
    with pytest.raises(ValueError, match="target_format"):
        _ds(cord, model_cfg, tok, target_format="xml")


def test_bad_rows_skipped_and_counted(cord, model_cfg, tok, caplog):
    ds = _ds(cord, model_cfg, tok)
    bad = cord[1]["bad"]
    assert set(bad.values()) == {"bad_image", "bad_json", "empty_answer", "missing_field"}
    with caplog.at_level(logging.WARNING, logger="data.cord_v2"):
        for i, reason in bad.items():
            before = ds.skipped[reason]
            assert ds[i] is None
            assert ds.skipped[reason] == before + 1
            assert f"sample {i} skipped ({reason})" in caplog.text
    assert sum(ds.skipped.values()) == len(bad)
    assert all(ds[i] is not None for i in range(len(ds)) if i not in bad)


def test_truncation_never_splits_the_image(cord, model_cfg, tok, ids):
    full = _ds(cord, model_cfg, tok)[0]
    image_end = int((full["input_ids"] == ids["vision_end_token_id"]).nonzero()[0]) + 1
    first_target = int(full["loss_mask"].nonzero()[0]) + 1
    # Room for the image and a few answer tokens: cut at the end, counted.
    seq = first_target + 3
    ds = _ds(cord, model_cfg, tok, seq=seq)
    s = ds[0]
    assert len(s["input_ids"]) == seq and ds.truncated == 1 and not ds.skipped
    assert torch.equal(s["input_ids"], full["input_ids"][:seq])
    assert torch.equal(s["position_ids"], full["position_ids"][:, :seq])
    # answer tokens first_target..seq-1 are kept; the last one has no label left to train on
    assert s["loss_mask"][-1] == 0 and s["labels"][-1] == -100 and s["loss_mask"].sum() == 3
    assert torch.equal(s["loss_mask"][:-1], full["loss_mask"][: seq - 1])
    # The image alone does not fit: skipped, never cut.
    ds = _ds(cord, model_cfg, tok, seq=image_end - 1)
    assert ds[0] is None and ds.skipped == {"image_too_long": 1} and ds.truncated == 0
    # The image fits but no answer token would be left: skipped too.
    ds = _ds(cord, model_cfg, tok, seq=first_target)
    assert ds[0] is None and ds.skipped == {"no_answer_left": 1}


def test_model_ids_must_match_tokenizer(cord, model_cfg, tok):
    with pytest.raises(ValueError, match="model.image_token_id=1000"):
        _ds(cord, dataclasses.replace(model_cfg, image_token_id=1000), tok)
    with pytest.raises(ValueError, match="vocab_size=256"):
        _ds(cord, dataclasses.replace(model_cfg, vocab_size=256), tok)


def test_other_layouts_and_missing_split(cord, model_cfg, tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.concat_tables([pq.read_table(f) for f in sorted(cord[0].glob("validation-*.parquet"))])
    (tmp_path / "hub" / "data").mkdir(parents=True)  # the hub repo keeps shards under data/
    pq.write_table(table, tmp_path / "hub" / "data" / "validation-00000-of-00001.parquet")
    (tmp_path / "disk" / "validation").mkdir(parents=True)  # datasets.save_to_disk
    with pa.OSFile(str(tmp_path / "disk" / "validation" / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    ref = _ds(cord, model_cfg, tok, split="validation")[1]
    for sub in ("hub", "disk"):
        got = _ds((tmp_path / sub,), model_cfg, tok, split="validation")[1]
        assert torch.equal(got["input_ids"], ref["input_ids"]) and torch.equal(got["pixel_values"], ref["pixel_values"])
    with pytest.raises(FileNotFoundError, match="split 'dev'"):
        _ds(cord, model_cfg, tok, split="dev")


# ---------------------------------------------------------------- loader and training integration


def test_loader_steps_over_skipped_rows_and_stops_on_mostly_bad_data(cord, model_cfg, tok):
    from data.loader import MicroBatchIterator

    ds = _ds(cord, model_cfg, tok)
    n_bad = len(cord[1]["bad"])
    it = MicroBatchIterator(ds, SEQ, model_cfg.pad_token_id, model_cfg.image_token_id, 2, False, 1, 0, 1)
    assert sorted(cord[1]["bad"]) == list(range(len(ds) - n_bad, len(ds)))  # bad rows sit at the end
    first = next(it)
    for _ in range(len(ds) - n_bad):  # the rest of the good rows, then past the bad ones to row 0 again
        last = next(it)
    assert it.bad == n_bad and it.seen == len(ds) + 1
    assert torch.equal(last["tokens"], first["tokens"])  # wrapped around to the first good row

    class MostlyBroken:
        skipped = {"bad_image": 19}

        def __len__(self):
            return 100

        def __getitem__(self, i):
            return None if i % 20 else ds[0]

    it = MicroBatchIterator(MostlyBroken(), SEQ, model_cfg.pad_token_id, model_cfg.image_token_id, 2, False, 1, 0, 1,
                            max_bad_fraction=0.5)
    next(it)
    with pytest.raises(RuntimeError, match="max_bad_fraction"):
        for _ in range(5):
            next(it)


def test_images_equal_transformers_qwen_image_processor(cord, model_cfg, tok):
    """Resize + normalise + patch order must be what HF's Qwen2-VL/Qwen3.5 processor feeds the
    released checkpoints (PIL backend, the same smart_resize bounds and mean/std)."""
    import io

    import numpy as np
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ds = _ds(cord, model_cfg, tok)
    rng = np.random.default_rng(0)
    for h, w in [(300, 170), (64, 900), (1000, 1000)]:
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        ours, grid = ds._image({"bytes": buf.getvalue()})
        hf = Qwen2VLImageProcessorPil(
            patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=list(ds.image_mean),
            image_std=list(ds.image_std), min_pixels=ds.min_pixels, max_pixels=ds.max_pixels,
        )(images=[img], return_tensors="pt")
        assert hf["image_grid_thw"][0].tolist() == grid.tolist()
        torch.testing.assert_close(ours, hf["pixel_values"], rtol=0, atol=1e-6)


def test_preprocessor_config_sets_normalisation_and_rejects_other_patching(tmp_path):
    from multimodal.config import ConfigError, load_config, resolve_sources

    tok_dir = tmp_path / "tok"
    build_tiny_tokenizer(tok_dir)
    pre = {"image_mean": [0.48, 0.45, 0.4], "image_std": [0.26, 0.26, 0.27], "patch_size": 16, "merge_size": 2}
    (tok_dir / "preprocessor_config.json").write_text(json.dumps(pre))
    cfg = resolve_sources(load_config(None, [f"data.tokenizer={tok_dir}"]))
    assert cfg.data.image_mean == pre["image_mean"] and cfg.data.image_std == pre["image_std"]
    (tok_dir / "preprocessor_config.json").write_text(json.dumps({**pre, "patch_size": 14}))
    with pytest.raises(ConfigError, match="patch_size=14"):
        resolve_sources(load_config(None, [f"data.tokenizer={tok_dir}"]))


def test_worker_processes_give_the_same_batches_skips_and_resume_state(cord, model_cfg, tok):
    """data.loader.num_workers=2 decodes rows in other processes; batches, skip counts and the resume
    index must be exactly those of the in-process loader."""
    from data.loader import MicroBatchIterator

    def loader(workers):
        return MicroBatchIterator(_ds(cord, model_cfg, tok), SEQ, model_cfg.pad_token_id, model_cfg.image_token_id,
                                  2, False, 1, 0, 1, max_bad_fraction=0.9, num_workers=workers)

    plain, parallel = loader(0), loader(2)
    n = len(plain.dataset) - len(cord[1]["bad"]) + 2  # through the bad rows at the end (once) and around
    for _ in range(n):
        a, b = next(plain), next(parallel)
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["pixel_values"], b["pixel_values"])
        assert plain.state_dict() == parallel.state_dict()
    assert parallel.bad == plain.bad == len(cord[1]["bad"])
    assert dict(parallel.dataset.skipped) == dict(plain.dataset.skipped) and sum(plain.dataset.skipped.values())

    resumed = loader(2)
    resumed.load_state_dict(parallel.state_dict())
    for _ in range(3):
        assert torch.equal(next(resumed)["tokens"], next(plain)["tokens"])


@pytest.mark.slow
def test_training_runs_on_cord_format_data(tmp_path):
    """pretrain_multimodal.py with data.name=cord_v2: ids from the tokenizer, two steps, finite loss."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "synthetic"
    env = {**os.environ, "PYTHONPATH": str(root)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    run = lambda *a: subprocess.run([sys.executable, *a], cwd=root, env=env, capture_output=True,  # noqa: E731
                                    text=True, timeout=600)
    made = run("scripts/make_synthetic_cord.py", "--out", str(out), "--train", "8")
    assert made.returncode == 0, made.stderr[-2000:]
    proc = run("pretrain_multimodal.py", "--config", "configs/qwen35_vl_proxy_cord.yaml", f"data.path={out / 'data'}",
               f"data.tokenizer={out / 'tokenizer'}", "train.iters=2", "checkpoint.dir=null",
               f"logging.dir={tmp_path / 'log'}", "logging.progress_bar=false", "data.max_pixels=16384")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(0 < r["loss"] < 20 for r in rows)
    # the process's first row says how long it took to get there (imports and model build are
    # seconds even here); later rows do not repeat it
    assert 1.0 < rows[0]["startup_s"] < 600 and "startup_s" not in rows[1]
    assert f"step 1 done {rows[0]['startup_s']:.1f} s after the process started" in proc.stdout + proc.stderr


def test_inspect_json_shows_exactly_the_supervised_answer(cord, tok, tmp_path, capsys):
    from multimodal.inspect_data import main as inspect_main

    tok.save_pretrained(tmp_path / "tok")
    rc = inspect_main(["--config", "configs/qwen35_vl_proxy_cord.yaml", "--num", "2", "--json",
                       f"data.path={cord[0]}", f"data.tokenizer={tmp_path / 'tok'}"])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in rows] == [0, 1]
    for r, gt in zip(rows, cord[1]["gt"]["train"]):
        assert r["supervised_text"] == json.dumps(gt, ensure_ascii=False) + "<|im_end|>"
        (t, h, w), = r["image_grid_thw"]
        assert r["num_image_tokens"] == t * h * w // 4
