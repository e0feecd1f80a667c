"""The training loop's log steps: the parameter norm as one multi-tensor reduction per dtype, and
the step clock that measures windows without a host sync (the loop itself, whose log lines
are read one step late, is covered end to end by tests/test_training.py: every step's row)."""

from __future__ import annotations

import time

import pytest
import torch

from multimodal.observability.step_clock import StepClock
from multimodal.training import _param_norm


def test_param_norm_is_the_norm_of_every_parameter_in_fp32(mcore):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    model[1].to(torch.bfloat16)  # mixed dtypes: grouped, each accumulated in fp32
    with torch.no_grad():
        model[1].weight.mul_(300.0)  # large enough that a bf16 sum of squares would round badly
    want = torch.sqrt(sum(p.detach().double().square().sum() for p in model.parameters()))
    got = _param_norm(model)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_param_norm_counts_a_shared_weight_once(mcore):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    model[1].weight.shared = True  # megatron's mark on the tied output-layer copy
    want = model[0].weight.detach().norm()
    assert _param_norm(model).item() == pytest.approx(want.item(), rel=1e-6)


def test_cpu_step_clock_windows_are_consecutive():
    clock = StepClock(is_cuda=False)
    first = clock.mark()
    time.sleep(0.02)
    second = clock.mark()
    assert first[1] == second[0]  # no time between windows goes uncounted
    assert clock.seconds(*second) >= 0.02


def test_a_failing_run_still_writes_the_last_log_step(tmp_path, monkeypatch):
    """Log lines are written one step late; a run that fails in the step after a log step must
    not lose that line (single process: nothing can hang on a peer)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = f"""
import sys
sys.path.insert(0, {str(root)!r})
import multimodal.training as tr
real = tr._Window.add
def add(self, batches, model_cfg):
    if self.steps == 0 and getattr(add, "calls", 0) == 2:
        raise RuntimeError("boom in step 3")
    add.calls = getattr(add, "calls", 0) + 1
    return real(self, batches, model_cfg)
tr._Window.add = add
from multimodal.config import load_config
cfg = load_config("configs/qwen35_vl_proxy.yaml", ["train.iters=4", "logging.interval=1", "logging.dir={tmp_path}",
    "logging.tensorboard=false", "logging.progress_bar=false", "checkpoint.dir=null", "train.seq_length=256",
    "data.mock.max_image_side=64"])
tr.train(cfg)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "boom in step 3" in proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # step 2's line, read after step 3 began, is there
