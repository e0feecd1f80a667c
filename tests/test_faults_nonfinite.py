"""Fault injection: non-finite losses (a huge learning rate) on every optimizer path the recipe
allows. The guard skips the update on the device, counts it, stops after
train.max_nonfinite_steps in a row with one line and exit code 2, and never writes a checkpoint
from non-finite weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers.fault_helpers import all_finite, checkpoint_tensors, run_cli
from multimodal.observability.metrics import console_line

pytestmark = pytest.mark.slow

# step 1 runs at lr 0 (warm-up from 0), step 2 at lr/2 blows the weights up, later steps are NaN
DIVERGE = ["optimizer.lr=1e3", "optimizer.min_lr=0", "optimizer.warmup_iters=2"]


@pytest.mark.parametrize("optimizer", [
    [],  # torch's fused AdamW with the deferred gradient scale (the CPU default)
    ["optimizer.defer_grad_scaling=false"],
    ["optimizer.fused=false"],  # foreach AdamW: the flag is read on the host
    ["optimizer.flat=true"],  # flat AdamW (its PyTorch reference on the CPU)
    ["optimizer.flat=true", "optimizer.overlap_step=true"],
])
def test_nan_steps_are_skipped_counted_and_stop_the_run(tmp_path, optimizer):
    ck = tmp_path / "ck"
    run = run_cli(tmp_path, *DIVERGE, *optimizer, "train.iters=12", "train.max_nonfinite_steps=3",
                  f"checkpoint.dir={ck}", "checkpoint.interval=2", "checkpoint.keep_last=1")
    assert run.rc == 2, run.stderr[-3000:]
    line = run.last_line
    assert line.startswith("error: step ") and "non-finite gradient norm (nan)" in line, line
    assert "train.max_nonfinite_steps=3 reached" in line and "lr " in line, line
    assert f"last good checkpoint: {ck}/iter_" in line, line
    assert "Traceback" not in run.stderr  # behind --verbose / in error.log
    assert "Traceback" in (tmp_path / "error.log").read_text()

    rows = run.rows()
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # every step once, the last one too
    skipped = [r["step"] for r in rows if r["skipped_steps"]]
    assert skipped and rows[-1]["skipped_total"] == 3 == sum(r["skipped_steps"] for r in rows)
    first_bad = skipped[0]
    assert first_bad >= 2
    assert rows[first_bad - 2]["loss"] is not None and math.isfinite(rows[first_bad - 2]["loss"])

    # what the checkpoints hold: finite weights and moments only; `latest` names one of them, and
    # the last good one named in the line (pruning keeps it) had normal losses and grad norms
    latest = (ck / "latest").read_text()
    kept = sorted(p.name for p in ck.glob("iter_*"))
    assert latest in kept
    good = Path(line.split("last good checkpoint: ")[1].split(";")[0])
    assert good.name in kept
    state = json.loads((good / "trainer_state.json").read_text())
    assert state["normal"] and all(math.isfinite(loss) and math.isfinite(g) for _, loss, g in state["history"])
    for name in kept:
        assert all_finite(checkpoint_tensors(ck / name)), name


def test_stop_mode_stops_at_the_first_nan_and_weights_never_go_to_a_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    run = run_cli(tmp_path, *DIVERGE, "train.iters=10", "train.on_nonfinite=stop", f"checkpoint.dir={ck}",
                  "checkpoint.interval=1")
    assert run.rc == 2, run.stderr[-3000:]
    assert "train.on_nonfinite=stop" in run.last_line and "1 update(s) skipped in a row" in run.last_line
    first_bad = next(r["step"] for r in run.rows() if r["skipped_steps"])
    saved = sorted(int(p.name[5:]) for p in ck.glob("iter_*"))
    assert saved and max(saved) < first_bad  # the step that went non-finite was never saved


def test_weights_that_overflow_are_never_saved(tmp_path):
    """A learning rate so large that one finite gradient makes the weights infinite: the gradient
    norm of that step was finite, so only the check before the save can catch it."""
    ck = tmp_path / "ck"
    run = run_cli(tmp_path, "optimizer.lr=1e39", "optimizer.min_lr=0", "optimizer.warmup_iters=0",
                  "train.iters=3", f"checkpoint.dir={ck}", "checkpoint.interval=1")
    assert run.rc == 2, run.stderr[-3000:]
    assert run.last_line.startswith("error: step 1: the weights are not finite, so no checkpoint was written")
    assert not list(ck.glob("iter_*")) and not (ck / "latest").exists()


def test_console_line_survives_missing_and_non_finite_values():
    line = console_line(7, {"loss": None, "grad_norm": float("nan"), "lr": float("inf"), "tokens_per_s": None,
                            "mfu": float("nan"), "skipped_steps": 2, "skipped_total": 5})
    assert "loss n/a" in line and "grad_norm nan" in line and "skipped 2" in line


def test_guard_skips_a_fused_adamw_step_on_the_device(mcore):
    """The mechanism underneath: the flag the guard hands the torch optimizer as found_inf."""
    from types import SimpleNamespace

    from multimodal.nonfinite import NonFiniteGuard

    p = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.AdamW([p], lr=0.1, fused=True)
    norm = {"value": torch.tensor(float("nan"))}
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adam)],
                              get_grad_norm=lambda: norm["value"])
    guard = NonFiniteGuard(chained, "skip", 2, torch.device("cpu"))
    p.grad = torch.full((3,), float("nan"))
    chained.get_grad_norm()
    adam.step()
    report = guard.after_step(1, 0.1, torch.tensor([float("nan"), 4.0]))
    assert torch.equal(p.detach(), torch.ones(3)) and report.tolist() == [0.0, 0.0]
    norm["value"] = torch.tensor(2.0)
    p.grad = torch.ones(3)
    chained.get_grad_norm()
    adam.step()
    guard.after_step(2, 0.1, torch.tensor([8.0, 4.0]))
    assert not torch.equal(p.detach(), torch.ones(3)) and float(adam.state[p]["step"]) == 1.0
    metrics, error = guard.review(2, guard.counters.tolist())
    assert metrics == {"skipped_steps": 1, "skipped_total": 1} and error is None


_SKIP_CHECK = r"""
import json, torch
from fused_kernels.flat_adamw import chunk_table, flat_adamw
torch.manual_seed(0)
n = 3000
starts, state_starts, lengths = chunk_table([(0, 1000), (1024, 1900)], "cpu")
hp = dict(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, step=3, zero_grad=True)
result = {}
for use_kernel in (True, False):
    torch.manual_seed(0)  # the same buffers for both
    p, m, v = torch.randn(n), torch.randn(n) * 1e-3, torch.rand(n) * 1e-4
    out = torch.full((n,), 7.0)
    before = [t.clone() for t in (p, m, v, out)]
    g = torch.full((n,), float("nan"))
    flat_adamw(p, g, m, v, out, starts, state_starts, lengths, skip=torch.ones(()), use_kernel=use_kernel, **hp)
    unchanged = all(torch.equal(a, b) for a, b in zip((p, m, v, out), before))
    zeroed = bool((g[:1000] == 0).all() and (g[1024:2924] == 0).all())
    g = torch.randn(n)
    flat_adamw(p, g, m, v, out, starts, state_starts, lengths, skip=torch.zeros(()), use_kernel=use_kernel, **hp)
    result["kernel" if use_kernel else "reference"] = {"unchanged": unchanged, "zeroed": zeroed,
                                                       "updated": not torch.equal(p, before[0]), "p": p.tolist()}
print(json.dumps(result))
"""


def test_flat_adamw_kernel_skips_on_the_device_flag_in_the_interpreter():
    """The Triton kernel (interpreter) and its reference: a flagged step writes nothing but the
    gradient zeros; an unflagged one updates, both alike."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _SKIP_CHECK], cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("kernel", "reference"):
        assert got[name]["unchanged"] and got[name]["zeroed"] and got[name]["updated"], (name, got[name])
    assert max(abs(a - b) for a, b in zip(got["kernel"]["p"], got["reference"]["p"])) < 1e-6


def test_last_good_checkpoint_is_the_last_one_whose_losses_were_normal():
    """Under a too-short warm-up a run diverges with finite, exploding numbers before the first
    NaN: the checkpoint written then is not "good", the one before is (kept in trainer state)."""
    from types import SimpleNamespace

    from multimodal.nonfinite import NonFiniteGuard

    def guard():
        return NonFiniteGuard(SimpleNamespace(chained_optimizers=[], get_grad_norm=lambda: 1.0), "skip", 10,
                              torch.device("cpu"))

    g = guard()
    for it, (loss, norm) in enumerate([(7.0, 5.0), (6.5, 4.0), (6.0, 4.5), (5.8, 4.2)], start=1):
        g.record(it, loss, norm)
    state = g.checkpoint_state()
    assert state["normal"] and len(state["history"]) == 4
    g.saved("ck/iter_0000004", state)
    g.record(5, 9.0, 400.0)  # finite, a hundred times the grad norm so far
    g.record(6, 30.0, 5e4)
    state = g.checkpoint_state()
    assert not state["normal"] and state["last_normal"] == "ck/iter_0000004"
    g.saved("ck/iter_0000006", state)
    assert g.last_good == "ck/iter_0000004"
    _, error = g.review(7, [10.0, 10.0, 7.0, float("nan"), float("nan")])  # max_nonfinite_steps reached
    assert "last good checkpoint: ck/iter_0000004" in str(error)
    resumed = guard()  # from the later checkpoint: the good one is still the earlier one
    resumed.resume(state, "ck/iter_0000006")
    assert resumed.last_good == "ck/iter_0000004"
    g.record(7, float("nan"), float("nan"))
    assert not g.checkpoint_state()["normal"]
