"""scripts/bench_train.py end to end on the proxy recipe on CPU (ours, then transformers, same batches)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ["train.seq_length=128", "train.global_batch_size=1", "data.mock.min_image_side=32", "data.mock.max_image_side=64",
        "data.mock.max_images=1", "data.mock.min_text_tokens=8", "data.mock.max_text_tokens=24", "logging.peak_tflops=1.0"]


def _bench(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "scripts/bench_train.py", "--config", "configs/qwen35_vl_proxy.yaml", *TINY,
           "--json", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc


def _positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
@pytest.mark.parametrize("feed,process", [("row", "fresh"), ("samples", "same")])
def test_bench_train_runs_both_frameworks_on_cpu(tmp_path, feed, process):
    """``fresh``: our run in a spawned process (the GPU default), its figures sent back."""
    res, proc = _bench(tmp_path, "--warmup", "1", "--steps", "2", "--hf-feed", feed, "--ours-process", process)
    assert res["ours_in_fresh_process"] is (process == "fresh")
    for key in ("tokens_per_s", "tflops_per_gpu", "mfu", "peak_mem_gib", "hf_tokens_per_s", "speedup_vs_hf",
                "hf_tflops_per_gpu", "hf_mfu", "step_time_s", "hf_step_time_s", "loss_last", "hf_loss_last"):
        assert _positive(res[key]), (key, res[key])
    assert res["device"] == "cpu" and res["config"] == "configs/qwen35_vl_proxy.yaml"
    assert res["hf_feed"] == feed and res["hf_gdn_kernels"] == "torch" and res["steps"] == 2
    assert res["gdn_kernels"] == "torch"  # ours, on the CPU
    assert 0 < res["real_token_fraction"] <= 1 and "real tokens" in proc.stderr
    # both sides are credited the same real tokens and FLOPs, so the ratios agree
    assert res["speedup_vs_hf"] == pytest.approx(res["tokens_per_s"] / res["hf_tokens_per_s"])
    assert res["tflops_per_gpu"] / res["hf_tflops_per_gpu"] == pytest.approx(res["speedup_vs_hf"], rel=1e-6)
    assert "ours / HF tokens/s" in proc.stderr
    # our half was written before transformers' started (a run cut short keeps it); then replaced
    assert "transformers next" in proc.stderr and "hf_error" not in res
    for key in ("step_time_median_s", "step_time_p90_s", "hf_step_time_median_s", "hf_step_time_p90_s"):
        assert _positive(res[key]), (key, res[key])
    assert res["step_time_p90_s"] >= res["step_time_median_s"]


@pytest.mark.slow
def test_bench_train_skip_hf(tmp_path):
    spec = "optimizer.flat=true,optimizer.overlap_step=true"
    res, proc = _bench(tmp_path, "--warmup", "0", "--steps", "1", "--skip-hf", "--recompute-sweep", "--ab", spec)
    # --ab: B (the overrides) and A again, each a fresh model on the same batches: the first
    # step's loss (before any update) is the same in all three
    ab = res["ab"][spec]
    assert set(ab) == {"b", "a_again"} and f"A/B {spec}" in proc.stderr
    for row in ab.values():
        assert _positive(row["step_time_s"]) and row["loss_last"] == res["loss_last"]
    for key in ("tokens_per_s", "tflops_per_gpu", "mfu", "peak_mem_gib"):
        assert _positive(res[key]), (key, res[key])
    assert res["hf_tokens_per_s"] is None and res["speedup_vs_hf"] is None
    sweep = res["recompute_sweep"]
    assert list(sweep) == ["none", "layernorm", "gdn_qkv", "gdn_norm_out", "core_attn",
                           "core_attn,gdn_norm_out,gdn_qkv,layernorm"]
    for row in sweep.values():
        assert _positive(row["step_time_s"]) and _positive(row["peak_mem_gib"]) and "saved_gib" in row
        # recompute never changes the forward: the same first-step loss for every choice
        assert row["loss_last"] == sweep["none"]["loss_last"]


def test_graph_captures_inside_the_timed_steps_are_counted():
    from scripts.bench_train import captures_in_timed_steps

    rows = [{"step": s, "cuda_graph_captures": c} for s, c in [(1, 2), (2, 3), (3, 3), (4, 5), (5, 5)]]
    assert captures_in_timed_steps(rows, warmup=3) == 2  # 3 after warm-up, 5 at the end
    assert captures_in_timed_steps(rows, warmup=4) == 0
    assert captures_in_timed_steps(rows, warmup=0) == 5
    assert captures_in_timed_steps([{"step": 1}, {"step": 2}], warmup=1) is None  # no graphs


def test_allocator_retries_inside_the_timed_steps_are_counted_and_warned_once(monkeypatch, caplog):
    """The trainer's rows carry the CUDA allocator's cumulative retries (a synchronizing free of
    its cache each): warned the first time they rise, and the bench reports the timed steps' share."""
    from multimodal import step_metrics
    from scripts.bench_train import alloc_retries_in_timed_steps

    rows = [{"step": s, "alloc_retries": c} for s, c in [(1, 0), (2, 1), (3, 1), (4, 4)]]
    assert alloc_retries_in_timed_steps(rows, warmup=2) == 3
    assert alloc_retries_in_timed_steps(rows, warmup=4) == 0
    assert alloc_retries_in_timed_steps([{"step": 1}], warmup=0) is None  # not on CUDA

    counts = iter([0, 2, 5])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"num_alloc_retries": next(counts)})
    monkeypatch.setattr(step_metrics._AllocRetries, "warned", False)
    with caplog.at_level("WARNING"):
        assert [step_metrics._AllocRetries.count(s) for s in (1, 2, 3)] == [0, 2, 5]
    warnings = [r.message for r in caplog.records if "caching allocator" in r.message]
    assert len(warnings) == 1 and "2 time(s) by step 2" in warnings[0] and "expandable_segments" in warnings[0]


def test_step_spread_and_eager_share():
    from scripts.bench_train import data_wait_per_step, eager_step_share, step_spread

    spread = step_spread([0.3, 0.1, 0.2, 0.9, 0.25, 0.2, 0.22, 0.21, 0.24, 0.23])
    assert spread == {"step_time_median_s": pytest.approx(0.225), "step_time_p90_s": 0.3}
    assert step_spread([]) == {"step_time_median_s": None, "step_time_p90_s": None}
    rows = [{"step": s, "cuda_graph_eager_batches": c} for s, c in [(1, 1), (2, 1), (3, 2), (4, 2), (5, 4)]]
    assert eager_step_share(rows, warmup=1) == 0.5  # steps 3 and 5 of 2-5 ran some layers eagerly
    assert eager_step_share(rows, warmup=0) == 0.6
    assert eager_step_share([{"step": 1}], warmup=0) is None  # no graphs
    waits = [{"step": s, "data_wait_s": w} for s, w in [(1, 0.5), (2, 0.5), (3, 0.9), (4, 1.3)]]
    assert data_wait_per_step(waits, warmup=2, steps=2) == pytest.approx(0.4)  # 0.8 s over steps 3-4
    assert data_wait_per_step([{"step": 1}], warmup=0, steps=1) is None  # no prefetch thread


def test_hf_inputs_keep_our_tokens_labels_and_images():
    """The packed micro-batch maps to transformers inputs without losing or shifting anything."""
    import torch

    from data.collate import pack_thd
    from data.mock import MockDataset
    from multimodal.config import load_config
    from scripts.bench_train import hf_calls

    cfg = load_config("configs/qwen35_vl_proxy.yaml")
    m = cfg.model
    ds = MockDataset(m, cfg.data, 512)
    samples = [ds[0], ds[1], ds[2]]
    batch = pack_thd(samples, 512, m.pad_token_id, m.image_token_id, m.vision.spatial_merge_size)
    (row,) = hf_calls(batch, m, "row")
    per = hf_calls(batch, m, "samples")
    assert len(per) == 3
    n = sum(len(s["input_ids"]) for s in samples)
    assert row["input_ids"].shape == (1, n) and row["input_ids"].shape[1] == batch["num_real_tokens"]
    assert torch.equal(row["input_ids"][0], torch.cat([s["input_ids"] for s in samples]))
    assert torch.equal(row["pixel_values"], batch["pixel_values"])
    assert torch.equal(row["image_grid_thw"], batch["image_grid_thw"].long())
    for call, s in zip(per, samples):
        assert torch.equal(call["input_ids"][0], s["input_ids"])
        # transformers scores logits[t] against labels[t + 1]: our supervised label of token t sits at t + 1
        sup = s["loss_mask"].bool()
        expect = torch.full_like(s["labels"], -100)
        expect[1:] = torch.where(sup, s["labels"], torch.full_like(s["labels"], -100))[:-1]
        assert torch.equal(call["labels"][0], expect)
        assert call["image_grid_thw"].shape[0] == len(s["image_grid_thw"])
    assert int((row["labels"] != -100).sum()) == int(batch["loss_mask"].sum())


def test_profiling_a_timed_step_is_refused(tmp_path):
    """The profiler's own cost (seconds of trace export) must not land in the timed steps."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "scripts/bench_train.py", "--config", "configs/qwen35_vl_proxy.yaml", *TINY,
           "--warmup", "3", "--steps", "2", "--skip-hf", "logging.profile_step=3", "logging.profile_num_steps=2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "profile warm-up steps only" in proc.stderr and "--warmup 3" in proc.stderr


@pytest.mark.slow
def test_bench_train_starts_from_a_hugging_face_folder_and_reports_mtp_loss(tmp_path):
    """checkpoint.load given on the command line is kept (the recipe's own resume is not): the bench
    starts from the folder's weights, with its MTP head, and reports the head's loss beside the LM's."""
    from scripts.make_synthetic_hf import main as make_synthetic_hf

    hf = tmp_path / "hf"  # the proxy's shapes (its special token ids fit the vocabulary), one MTP layer
    assert make_synthetic_hf(["--out", str(hf), "--config", "configs/qwen35_vl_proxy.yaml", "--layers", "2",
                              "--mtp", "1"]) == 0
    res, proc = _bench(tmp_path, "--warmup", "0", "--steps", "1", "--skip-hf", f"checkpoint.load={hf}",
                       "--ab", "model.mtp_num_layers=0")
    assert "straight from the Hugging Face folder" in proc.stderr
    assert _positive(res["mtp_loss_last"]) and "mtp_loss" in proc.stderr  # depth 1, as the folder's config
    off = res["ab"]["model.mtp_num_layers=0"]
    assert off["b"]["mtp_loss_last"] is None and off["a_again"]["mtp_loss_last"] == res["mtp_loss_last"]
    # the same loaded weights: MTP adds its own loss and leaves the LM's first-step loss as it was
    assert off["b"]["loss_last"] == pytest.approx(res["loss_last"], rel=1e-6)


def test_bench_train_refuses_a_training_checkpoint_to_start_from(tmp_path):
    """A resume would continue the checkpoint's step count past the bench's few steps: only a
    Hugging Face folder (weights) is taken, in one line."""
    from scripts.bench_train import BenchError, main

    with pytest.raises(BenchError, match="give it a Hugging Face folder"):
        main(["--config", "configs/qwen35_vl_proxy.yaml", "--skip-hf", f"checkpoint.load={tmp_path}"])
