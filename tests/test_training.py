"""End-to-end training runs of the real entry point (subprocesses, CPU, gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from multimodal import checkpointing

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(tmp: Path, *overrides: str, config="configs/qwen35_vl_proxy.yaml", nproc: int = 1) -> dict[int, dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if nproc == 1:
        cmd = [sys.executable, "pretrain_multimodal.py"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={_free_port()}", "pretrain_multimodal.py"]
    cmd += ["--config", config, f"logging.dir={tmp}", "logging.progress_bar=false", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def test_proxy_recipe_loss_falls_and_metrics_are_complete(tmp_path):
    rows = _train(tmp_path, f"checkpoint.dir={tmp_path / 'ck'}")
    assert sorted(rows) == list(range(1, 31))
    first, last = rows[1]["loss"], rows[30]["loss"]
    assert last < 0.5 * first, (first, last)
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "tflops_per_gpu", "mfu", "mem_peak_gib"):
        assert key in rows[30]
    assert rows[30]["tokens_per_s"] > 0 and rows[30]["tflops_per_gpu"] > 0
    # real tokens over processed ones: the row's padding shows, and only real tokens count
    assert 0.5 < rows[30]["real_token_fraction"] <= 1.0
    assert (tmp_path / "ck" / "latest").read_text() == "iter_0000030"
    assert list((tmp_path / "tensorboard").iterdir())


def test_second_family_trains_through_the_same_entry_point(tmp_path):
    """models/tiny_dense_vl (no GDN, MRoPE or MoE; one registry line) trains on the mock data: the
    answers are readable only from the pixels, so a falling loss needs its vision path too."""
    rows = _train(tmp_path, config="tests/fixtures/tiny_dense_vl.yaml")
    assert sorted(rows) == list(range(1, 21))
    first, last = rows[1]["loss"], rows[20]["loss"]
    assert last < 0.5 * first, (first, last)
    assert rows[20]["tflops_per_gpu"] > 0  # its family counted the FLOPs


@pytest.mark.parametrize("optimizer", [["optimizer.flat=null"], ["optimizer.flat=true"],
                                       ["optimizer.flat=true", "optimizer.overlap_step=true"]])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, optimizer):
    # data.loader.prefetch=2: checkpoints must record the batches consumed, not the ones built ahead.
    # optimizer.flat=true: the moments are views of flat buffers, re-bound after the load.
    # optimizer.overlap_step=true: the save waits for the update; the resumed run learns the
    # forward order again and skips no zeroing it should not (its first step zeroes as usual).
    common = ["train.seq_length=256", "train.global_batch_size=1", "train.iters=20",
              "data.mock.max_image_side=64", "data.mock.max_text_tokens=48", "data.loader.prefetch=2", *optimizer]
    full = _train(tmp_path / "full", *common, f"checkpoint.dir={tmp_path / 'ck_full'}", "checkpoint.interval=10")
    first = _train(tmp_path / "a", *common, "train.iters=10", "optimizer.decay_iters=20",
                   f"checkpoint.dir={tmp_path / 'ck'}")
    resumed = _train(tmp_path / "b", *common, f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.load=latest")
    assert sorted(resumed) == list(range(11, 21))
    for step in range(1, 11):
        assert first[step]["loss"] == full[step]["loss"]
    for step in range(11, 21):
        assert resumed[step]["loss"] == full[step]["loss"], step
        assert resumed[step]["lr"] == full[step]["lr"], step


def test_flat_adamw_checkpoint_resumes_without_it(tmp_path):
    """A checkpoint written by a run with optimizer.flat=true (its moments and main params are
    views of flat buffers) resumes in a run without it: the same format as torch's AdamW. The two
    AdamW paths differ in the last bits, so the resumed losses match to rounding, not exactly."""
    common = ["train.seq_length=256", "train.global_batch_size=1", "train.iters=12",
              "data.mock.max_image_side=64", "data.mock.max_text_tokens=48"]
    full = _train(tmp_path / "full", *common, "optimizer.flat=false", "checkpoint.dir=null")
    _train(tmp_path / "a", *common, "train.iters=6", "optimizer.decay_iters=12", "optimizer.flat=true",
           f"checkpoint.dir={tmp_path / 'ck'}")
    resumed = _train(tmp_path / "b", *common, "optimizer.flat=false", f"checkpoint.dir={tmp_path / 'ck'}",
                     "checkpoint.load=latest")
    assert sorted(resumed) == list(range(7, 13))
    for step in range(7, 13):
        assert resumed[step]["loss"] == pytest.approx(full[step]["loss"], rel=1e-4), step
        assert resumed[step]["lr"] == full[step]["lr"], step


def test_torchrun_data_parallel_on_cpu(tmp_path):
    rows = _train(tmp_path, "train.iters=4", "train.global_batch_size=2", "train.seq_length=256",
                  "data.mock.max_image_side=64", "data.mock.max_text_tokens=48", "checkpoint.dir=null", nproc=2)
    assert sorted(rows) == [1, 2, 3, 4]
    assert rows[4]["loss"] < rows[1]["loss"]


def test_wandb_offline_and_parameter_norm(tmp_path):
    pytest.importorskip("wandb")
    rows = _train(tmp_path, "train.iters=2", "train.seq_length=256", "data.mock.max_image_side=64",
                  "data.mock.max_text_tokens=48", "checkpoint.dir=null", "logging.wandb=true")
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert rows[2]["param_norm"] > 0


def test_incomplete_checkpoints_are_never_loaded(tmp_path):
    good = tmp_path / "iter_0000010"
    good.mkdir()
    (good / "trainer_state.json").write_text("{}")
    (tmp_path / "iter_0000020.tmp").mkdir()  # a crash mid-save leaves this behind
    (tmp_path / "latest").write_text("iter_0000010")
    assert checkpointing.resolve("latest", str(tmp_path)) == good
    assert checkpointing.resolve(str(tmp_path), None) == good
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        checkpointing.resolve(str(tmp_path / "iter_0000020.tmp"), None)
    assert checkpointing.resolve("latest", str(tmp_path / "empty")) is None
