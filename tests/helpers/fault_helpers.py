"""Driving the real entry point into faults: a tiny proxy run as a subprocess, its exit code, its
console's last line and its metrics; and reading a checkpoint's tensors without the model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROXY = "configs/qwen35_vl_proxy.yaml"
# a few seconds per step on two CPU cores
TINY = ["train.seq_length=256", "train.global_batch_size=1", "data.mock.max_image_side=64", "data.mock.max_text_tokens=48",
        "logging.progress_bar=false", "logging.tensorboard=false"]


@dataclass
class Run:
    rc: int
    stderr: str
    log_dir: Path

    @property
    def last_line(self) -> str:
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def rows(self) -> list[dict]:
        path = self.log_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def run_cli(log_dir: Path, *overrides: str, prelude: str = "", config: str = PROXY, tiny: bool = True) -> Run:
    """``pretrain_multimodal.py`` in a subprocess; ``prelude``: Python run first in that process
    (to inject a fault by patching a function)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "WANDB_MODE"):
        env.pop(k, None)
    args = ["--config", config, f"logging.dir={log_dir}", *(TINY if tiny else []), *overrides]
    code = f"{prelude}\nimport sys, runpy\nsys.argv = ['pretrain_multimodal.py', *{args!r}]\n" \
           "runpy.run_path('pretrain_multimodal.py', run_name='__main__')\n"
    # stderr to a file, not a pipe, and the run in its own session: a run killed with SIGKILL
    # leaves megatron's checkpoint-writer process behind, which would hold a pipe open forever;
    # whatever of the session is left is killed afterwards (only processes this run started)
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    err_path = Path(log_dir) / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=err, start_new_session=True)
        try:
            rc = proc.wait(timeout=900)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return Run(rc, err_path.read_text(), Path(log_dir))


def checkpoint_tensors(path: Path) -> dict:
    """Every tensor of a dist checkpoint (model and optimizer), read without building the model."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(path))
    meta = reader.read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def all_finite(tensors: dict) -> bool:
    import torch

    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())
