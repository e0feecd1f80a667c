"""Shared fixtures: one gloo process group (world size 1) for in-process model tests; tests marked
``gpu`` are skipped where there is no CUDA device (tests/gpu/: ``pytest -m gpu tests/gpu`` on a GPU)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.fixture(scope="session")
def mcore():
    """torch.distributed (gloo, 1 rank) + megatron model-parallel state with every size 1."""
    os.environ.pop("RANK", None)
    os.environ.pop("WORLD_SIZE", None)
    from megatron.core import parallel_state as ps

    from multimodal.platform import init_distributed

    rt = init_distributed()
    if not ps.model_parallel_is_initialized():  # (an in-process run before may have left it, below)
        ps.initialize_model_parallel(1, 1)
    yield rt
    ps.destroy_model_parallel()


@pytest.fixture(autouse=True)
def _model_parallel_state_after_an_in_process_run():
    """A training run in this process (multimodal.training.train) sets up its own megatron parallel
    state and tears it down at the end; the tests after it on ``mcore`` find the size-1 state again."""
    yield
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None:
        return
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() == 1 and not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)


@pytest.fixture(scope="session")
def clipped_proxy_runs(tmp_path_factory):
    """4 steps of the proxy with a small clip_grad (clipping acts on every step) under each
    optimizer path that tests/test_multi_tensor.py, tests/test_flat_adamw.py and
    tests/test_overlap_update.py compare, one after another in one process of the entry point
    (tests/test_training.py's worker). ``default``: the
    CPU default, torch's fused AdamW with the gradient scale deferred into it. Returns
    rows(name): that run's metrics rows in step order."""
    from test_training import _train_in_one_process

    common = ["--config", "configs/qwen35_vl_proxy.yaml", "train.iters=4", "train.seq_length=256", "checkpoint.dir=null",
              "logging.tensorboard=false", "optimizer.clip_grad=0.05"]
    rows = _train_in_one_process(tmp_path_factory.mktemp("clipped_proxy"), {
        "default": common,
        "foreach": [*common, "optimizer.fused=false"],
        "passes": [*common, "optimizer.defer_grad_scaling=false"],
        "flat": [*common, "optimizer.flat=true"],
        "not_flat": [*common, "optimizer.flat=false"],
        "overlap": [*common, "optimizer.flat=true", "optimizer.overlap_step=true", "optimizer.overlap_step_pieces=5"],
        "no_overlap": [*common, "optimizer.flat=true", "optimizer.overlap_step=false"],
    })
    return lambda name: [r for _, r in sorted(rows(name).items())]


def pytest_collection_modifyitems(config, items):
    """A ``gpu``-marked test needs a CUDA device: without one it is skipped (``-ra`` counts the skips)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
