"""Logs after faults: metrics.jsonl holds every logged step exactly once after kills and resumes,
and the recipe's wandb_mode wins over WANDB_MODE unless it is left unset."""

from __future__ import annotations

import json
import sys
import types

import pytest

from helpers.fault_helpers import run_cli
from multimodal.config import LoggingConfig
from multimodal.observability.metrics import MetricsSink, drop_rows_after

# SIGKILL in the middle of step 6 (its forward/backward done, before its log and save)
KILL_IN_STEP_6 = """
import os, signal
import multimodal.training as tr
real = tr._Window.add
def add(self, batches, model_cfg):
    add.steps = getattr(add, "steps", 0) + 1
    if add.steps == 6:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, batches, model_cfg)
tr._Window.add = add
"""


@pytest.mark.slow
def test_kill_and_resume_log_every_step_exactly_once(tmp_path):
    ck = tmp_path / "ck"
    opts = ["train.iters=7", "checkpoint.interval=3", f"checkpoint.dir={ck}", "logging.interval=1"]
    killed = run_cli(tmp_path, *opts, prelude=KILL_IN_STEP_6)
    assert killed.rc == -9, killed.stderr[-2000:]
    before = [r["step"] for r in killed.rows()]
    assert before == [1, 2, 3, 4]  # step 3 was written before its checkpoint; 4 is past it
    assert (ck / "latest").read_text() == "iter_0000003"
    resumed = run_cli(tmp_path, *opts, "checkpoint.load=latest")
    assert resumed.rc == 0, resumed.stderr[-2000:]
    assert [r["step"] for r in resumed.rows()] == [1, 2, 3, 4, 5, 6, 7]
    assert "dropped 1 row(s) past step 3" in resumed.stderr


def test_drop_rows_after_keeps_earlier_rows_and_a_torn_line_goes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    assert drop_rows_after(path, 3) == 3
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]
    assert drop_rows_after(path, 3) == 0


@pytest.mark.parametrize("recipe, env, want", [("disabled", "online", "disabled"), (None, "online", "online"),
                                               (None, None, "offline"), ("online", None, "online")])
def test_recipe_wandb_mode_wins_over_the_environment(tmp_path, monkeypatch, recipe, env, want):
    seen = {}
    fake = types.SimpleNamespace(init=lambda **kw: seen.update(kw) or types.SimpleNamespace(finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    if env is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", env)
    cfg = LoggingConfig(dir=str(tmp_path), tensorboard=False, wandb=True, wandb_mode=recipe, progress_bar=False)
    MetricsSink(cfg, True, 10, 0, {}).close()
    assert seen["mode"] == want
