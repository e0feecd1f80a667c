"""Memory tools: allocator-history snapshots (CUDA API faked on CPU), manual GC, config checks."""

from __future__ import annotations

import gc
import logging
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from multimodal.observability import memory
from multimodal.config import ConfigError, load_config, validate
from multimodal.observability.memory import MemoryTools

ROOT = Path(__file__).resolve().parents[1]


def _cfg(tmp_path, **kw):
    base = dict(dir=str(tmp_path), memory_history=False, memory_snapshot_step=3, manual_gc_interval=0)
    return SimpleNamespace(**{**base, **kw})


def test_config_keys_are_validated():
    cfg = load_config("configs/qwen35_vl_proxy.yaml", ["logging.memory_history=true", "logging.manual_gc_interval=5"])
    assert cfg.logging.memory_history and cfg.logging.manual_gc_interval == 5 and cfg.logging.memory_snapshot_step == 3
    validate(cfg)
    for bad, field in (("logging.memory_snapshot_step=0", "memory_snapshot_step"),
                       ("logging.manual_gc_interval=-1", "manual_gc_interval")):
        with pytest.raises(ConfigError, match=field):
            validate(load_config("configs/qwen35_vl_proxy.yaml", [bad]))
    with pytest.raises(ConfigError, match="memory_history"):
        load_config(None, ["logging.memory_history=3"])


def test_history_is_a_logged_no_op_without_cuda(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="multimodal.observability.memory"):
        tools = MemoryTools(_cfg(tmp_path, memory_history=True), is_cuda=False).start()
    assert sum("no CUDA device" in r.message for r in caplog.records) == 1
    for it in range(1, 5):
        tools.after_step(it)
    tools.close()
    assert not tools.recording and not list(tmp_path.iterdir())


class _FakeCudaMemory:
    """Stands in for torch.cuda.memory's private history API on a machine without a GPU."""

    def __init__(self):
        self.calls = []

    def _record_memory_history(self, enabled="all", max_entries=None, **kw):
        self.calls.append(("record", enabled, max_entries))

    def _snapshot(self):
        self.calls.append(("snapshot",))
        return {"segments": [], "device_traces": [[{"action": "alloc", "size": 512}]]}


def test_snapshot_after_step_n_then_recording_stops(tmp_path, monkeypatch):
    fake = _FakeCudaMemory()
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake._record_memory_history)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", fake._snapshot)
    observers = []
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", observers.append, raising=False)

    tools = MemoryTools(_cfg(tmp_path, memory_history=True, memory_snapshot_step=2), is_cuda=True, rank=1).start()
    assert fake.calls == [("record", "all", memory.MAX_ENTRIES)] and observers == [tools._on_oom]
    tools.after_step(1)
    assert not (tmp_path / "memory_snapshot_rank1.pickle").exists()
    tools.after_step(2)
    snap = pickle.loads((tmp_path / "memory_snapshot_rank1.pickle").read_bytes())
    assert snap["device_traces"][0][0]["size"] == 512
    assert fake.calls[-1] == ("record", None, None) and not tools.recording  # stopped after the dump
    n = len(fake.calls)
    tools.after_step(3)
    tools.close()
    assert len(fake.calls) == n  # nothing more recorded or written
    tools._on_oom(0, 1 << 30, 0, 0)  # an OOM after recording stopped writes nothing
    assert not (tmp_path / "memory_snapshot_oom_rank1.pickle").exists()


def test_oom_observer_and_short_runs_still_leave_a_snapshot(tmp_path, monkeypatch):
    fake = _FakeCudaMemory()
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake._record_memory_history)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", fake._snapshot)
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", lambda fn: None, raising=False)
    tools = MemoryTools(_cfg(tmp_path, memory_history=True, memory_snapshot_step=10), is_cuda=True).start()
    tools._on_oom(0, 1 << 30, 0, 0)
    assert (tmp_path / "memory_snapshot_oom.pickle").exists()
    tools.after_step(1)
    tools.close()  # the run ended before step 10: the snapshot is written at exit
    assert (tmp_path / "memory_snapshot.pickle").exists()


def test_manual_gc_every_n_steps(tmp_path, monkeypatch):
    collected = []
    monkeypatch.setattr(memory.gc, "collect", lambda *a: collected.append(True) or 0)
    assert gc.isenabled()
    tools = MemoryTools(_cfg(tmp_path, manual_gc_interval=3), is_cuda=False).start()
    try:
        assert not gc.isenabled()
        collected.clear()  # the one at start
        steps = []
        for it in range(1, 10):
            before = len(collected)
            tools.after_step(it)
            if len(collected) > before:
                steps.append(it)
        assert steps == [3, 6, 9]
    finally:
        tools.close()
    assert gc.isenabled()


def test_manual_gc_off_leaves_the_collector_alone(tmp_path):
    tools = MemoryTools(_cfg(tmp_path), is_cuda=False).start()
    assert gc.isenabled()
    tools.close()
    assert gc.isenabled()


@pytest.mark.slow
def test_training_runs_with_memory_tools_on_cpu(tmp_path):
    env_cmd = [sys.executable, "pretrain_multimodal.py", "--config", "configs/qwen35_vl_proxy.yaml",
               f"logging.dir={tmp_path}", "logging.progress_bar=false", "train.iters=2", "train.seq_length=256",
               "train.global_batch_size=1", "data.mock.max_image_side=64", "data.mock.max_text_tokens=48",
               "checkpoint.dir=null", "logging.memory_history=true", "logging.manual_gc_interval=1"]
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(env_cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "no CUDA device" in proc.stderr + proc.stdout
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
