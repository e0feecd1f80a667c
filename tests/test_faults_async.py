"""Asynchronous checkpoint saves (checkpoint.async_save): training goes on while a save is
written; `latest` moves only once it is complete, so a kill -9 during the write leaves the
previous checkpoint as `latest`, loadable; the final save is waited for."""

from __future__ import annotations

import pytest

from fault_helpers import run_cli
from multimodal.checkpoint_checks import manifest_problem

pytestmark = pytest.mark.slow

def _slow_write_then(sig: str, at_step: int, sleep_s: int) -> str:
    """A prelude: the writer process of the save at step 4 sleeps ``sleep_s`` seconds (once per
    writer, not once per tensor), and the run sends itself ``sig`` in step ``at_step``."""
    return f"""
import functools, os, signal, time
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
real = fa._write_item
@functools.wraps(real)
def slow(*args, **kwargs):
    stream = next(a for a in args if hasattr(a, "write"))
    if "iter_0000004" in str(getattr(stream, "name", "")) and not getattr(slow, "slept", False):
        slow.slept = True
        time.sleep({sleep_s})
    return real(*args, **kwargs)
fa._write_item = slow
import multimodal.training as tr
real_add = tr._Window.add
def add(self, batches, model_cfg):
    add.steps = getattr(add, "steps", 0) + 1
    if add.steps == {at_step}:
        os.kill(os.getpid(), signal.{sig})
    return real_add(self, batches, model_cfg)
tr._Window.add = add
"""


# the save at step 4 is still being written when the run kills itself (SIGKILL) in step 6
SLOW_WRITE_THEN_KILL = _slow_write_then("SIGKILL", 6, 600)
# the save at step 4 takes a few seconds in its writer process; SIGTERM arrives in step 5
SLOW_WRITE_THEN_SIGTERM = _slow_write_then("SIGTERM", 5, 5)


def test_async_saves_complete_and_resume(tmp_path):
    ck = tmp_path / "ck"
    run = run_cli(tmp_path, "train.iters=4", "checkpoint.interval=2", f"checkpoint.dir={ck}",
                  "checkpoint.async_save=true")
    assert run.rc == 0, run.stderr[-3000:]
    assert (ck / "latest").read_text() == "iter_0000004"  # the final save was waited for
    assert sorted(p.name for p in ck.glob("iter_*")) == ["iter_0000002", "iter_0000004"]
    assert all(manifest_problem(ck / n) is None for n in ("iter_0000002", "iter_0000004"))
    resumed = run_cli(tmp_path / "b", "train.iters=5", f"checkpoint.load={ck}", "checkpoint.dir=null")
    assert resumed.rc == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in resumed.rows()] == [5]


def test_kill_during_an_async_save_keeps_the_previous_latest(tmp_path):
    ck = tmp_path / "ck"
    run = run_cli(tmp_path, "train.iters=8", "checkpoint.interval=2", f"checkpoint.dir={ck}",
                  "checkpoint.async_save=true", prelude=SLOW_WRITE_THEN_KILL)
    assert run.rc == -9, run.stderr[-3000:]
    assert (ck / "latest").read_text() == "iter_0000002"
    assert not (ck / "iter_0000004").exists()  # only its .tmp, never loaded
    assert manifest_problem(ck / "iter_0000002") is None
    resumed = run_cli(tmp_path / "b", "train.iters=3", f"checkpoint.dir={ck}", "checkpoint.load=latest",
                      "checkpoint.async_save=true")
    assert resumed.rc == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in resumed.rows()] == [3]




def test_sigterm_waits_for_the_save_in_flight(tmp_path):
    ck = tmp_path / "ck"
    run = run_cli(tmp_path, "train.iters=8", "checkpoint.interval=2", f"checkpoint.dir={ck}",
                  "checkpoint.async_save=true", prelude=SLOW_WRITE_THEN_SIGTERM)
    assert run.rc == 143, run.stderr[-3000:]
    assert "SIGTERM: the checkpoint being written is complete; stopping before step 6" in run.stderr
    assert (ck / "latest").read_text() == "iter_0000004" and manifest_problem(ck / "iter_0000004") is None
