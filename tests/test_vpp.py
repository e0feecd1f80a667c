"""Interleaved (virtual) pipeline parallelism against one process (CPU, gloo, fp32).

One 4-process launch (tests/helpers/mp_vpp.py) trains the dense proxy (4 layers: one per model
chunk) with the Trainer under PP=2 x VPP=2 x TP=2 on packed THD rows (several samples per row, so
every chunk must cut attention and the GDN scan at the right ``cu_seqlens``): once with the
distributed optimizer, once with megatron's plain one saving a checkpoint at step 2. In this
process the Trainer trains the one-process model (megatron's no-pipelining schedule) and resumes
the PP=2 x VPP=2 checkpoint under PP=1. Every run starts from its own layout-independent init of
the same seed; the losses, gradient norms, supervised tokens and the step's tokens and FLOPs
(counted once per model replica) must agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_parallel import _compare as compare_runs
from test_parallel import _free_port

ROOT = Path(__file__).resolve().parents[1]
DENSE = "configs/qwen35_vl_proxy.yaml"
STEPS = 3
ROWS = [f"train.iters={STEPS}", "checkpoint.dir=null", "model.attention_backend=sdpa", "model.gdn_backend=torch",
        "train.seq_length=256", "train.global_batch_size=2", "data.mock.max_image_side=64", "data.mock.max_text_tokens=48",
        "data.loader.pad_multiple=2", "logging.progress_bar=false", "logging.tensorboard=false"]
DIST_OPT = "parallel.use_distributed_optimizer=true"
LAYOUT = ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2"]
LOSS_TOL = 1e-5  # the logged (per-token mean) loss of a step
# TP=2 sums in another order; Adam carries the last-bit differences into the next steps' grads
GRAD_NORM_RTOL = 2e-5


def _launch(tmp: Path, runs: list[dict], nproc: int) -> None:
    spec = tmp / "runs.json"
    spec.write_text(json.dumps(runs))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                           f"--master-port={_free_port()}", "tests/helpers/mp_vpp.py", str(spec)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _metrics(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _compare(ref: dict, got: dict, what: str, world: float = 4) -> tuple[float, float]:
    return compare_runs(ref, got, what, world, LOSS_TOL, GRAD_NORM_RTOL, whole_run=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mcore):
    from tests.helpers.mp_vpp import train_in_process

    tmp = tmp_path_factory.mktemp("vpp")
    dist, plain = tmp / "dist", tmp / "plain"
    _launch(tmp, [dict(config=DENSE, overrides=[*ROWS, *LAYOUT, DIST_OPT, f"logging.dir={dist}",
                                                f"checkpoint.dir={dist / 'ckpt'}", "checkpoint.interval=2"]),
                  dict(config=DENSE, overrides=[*ROWS, *LAYOUT, f"logging.dir={plain}",
                                                f"checkpoint.dir={plain / 'ckpt'}", "checkpoint.interval=2"])], nproc=4)
    train_in_process(DENSE, [*ROWS, DIST_OPT, f"logging.dir={tmp / 'ref'}"])
    train_in_process(DENSE, [*ROWS, f"logging.dir={tmp / 'resumed'}",
                             f"checkpoint.load={plain / 'ckpt' / 'iter_0000002'}"])
    return {**{k: _metrics(tmp / k) for k in ("ref", "dist", "plain", "resumed")}, "tmp": tmp}


@pytest.mark.slow
def test_pp2_vpp2_tp2_trains_like_one_process(runs):
    """PP=2 x VPP=2 x TP=2 (interleaved schedule) with the distributed optimizer and with the plain
    one logs the one-process losses, gradient norms, tokens and FLOPs step by step, and trains."""
    ref = runs["ref"]
    assert sorted(ref) == list(range(1, STEPS + 1))
    _compare(ref, runs["dist"], "pp=2 vpp=2 tp=2 + distributed optimizer")
    _compare(ref, runs["plain"], "pp=2 vpp=2 tp=2")
    assert runs["dist"][STEPS]["loss"] < runs["dist"][1]["loss"]


@pytest.mark.slow
def test_pp2_vpp2_checkpoint_resumes_under_pp1(runs):
    """A checkpoint saved at step 2 under PP=2 x VPP=2 x TP=2 (plain optimizer: its per-parameter
    state is stored under global keys, megatron's distributed optimizer's buckets are not) loads under
    PP=1 x TP=1, and the later steps log the losses the PP=2 x VPP=2 run logged."""
    resumed, plain = runs["resumed"], runs["plain"]
    assert sorted(resumed) == list(range(3, STEPS + 1))
    _compare(plain, resumed, "pp=2 vpp=2 tp=2 checkpoint resumed at pp=1", world=1 / 4)


@pytest.mark.slow
def test_distributed_optimizer_checkpoint_under_another_layout_is_refused_in_one_line(runs):
    """The distributed optimizer's state is stored per gradient bucket of the layout it ran under:
    loading it under PP=1 stops before any tensor is read, naming both layouts and the fix."""
    from core.errors import CheckpointError
    from tests.helpers.mp_vpp import train_in_process

    tmp = runs["tmp"]
    with pytest.raises(CheckpointError) as err:
        train_in_process(DENSE, [*ROWS, DIST_OPT, f"logging.dir={tmp / 'refused'}",
                                 f"checkpoint.load={tmp / 'dist' / 'ckpt' / 'iter_0000002'}"])
    msg = str(err.value)
    assert "tp=2 pp=2 vpp=2 ep=1" in msg and "this run is tp=1 pp=1 vpp=1 ep=1" in msg and "\n" not in msg, msg



@pytest.mark.parametrize("num_layers,pp,vpp,first,last", [
    (8, 2, 2, None, None), (8, 4, 2, None, None), (12, 4, 2, 2, 2), (10, 2, 2, 4, None), (6, 3, 1, 1, 1),
    (14, 3, 2, 2, None), (60, 4, 5, 5, 15),
])
def test_chunk_layers_are_megatrons_split(num_layers, pp, vpp, first, last):
    """ParallelConfig.chunk_layers (what the dry run counts) is the split megatron builds and numbers
    its layers by (get_transformer_layer_offset / get_num_layers_to_build per rank and vp stage), and
    every layer lands in exactly one chunk."""
    import torch
    from megatron.core.transformer import TransformerConfig

    from models.common.parallel_config import ParallelConfig
    from models.common.virtual_pipeline import chunk_layers, megatron_pipeline

    p = ParallelConfig(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
    p.check_pipeline(num_layers)
    tcfg = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=1,
                             pipeline_dtype=torch.float32, **megatron_pipeline(p))
    ours = p.chunk_layers(num_layers)
    for r in range(pp):
        for v in range(vpp):
            assert ours[r][v] == chunk_layers(tcfg, v if vpp > 1 else None, pp_rank=r), (r, v)
    assert sorted(i for rank in ours for chunk in rank for i in chunk) == list(range(num_layers))


@pytest.mark.parametrize("fields,num_layers,microbatches,fragment", [
    (dict(vpp=2), 4, 2, "needs parallel.pp > 1"),
    (dict(pp=2, vpp=4), 4, 2, "divisible by parallel.pp x parallel.vpp"),
    (dict(pp=2, vpp=2), 4, 3, "multiple of parallel.pp (2) micro-batches"),
    (dict(pp=2, vpp=2, first_stage_layers=1), 4, 2, "positive multiple of parallel.vpp"),
    (dict(pp=4, vpp=2, first_stage_layers=2, last_stage_layers=2), 14, 4, "split evenly over the other 2"),
    (dict(pp=2, first_stage_layers=3, last_stage_layers=3), 4, 2, "must leave the 0 other"),
    (dict(first_stage_layers=2), 4, 2, "need parallel.pp > 1"),
])
def test_bad_pipeline_layouts_are_refused_in_one_line(fields, num_layers, microbatches, fragment):
    from core.errors import ConfigError
    from models.common.parallel_config import ParallelConfig

    with pytest.raises(ConfigError, match=None) as err:
        ParallelConfig(**fields).check_pipeline(num_layers, microbatches)
    assert fragment in str(err.value) and "\n" not in str(err.value), str(err.value)
