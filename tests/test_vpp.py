"""Interleaved (virtual) pipeline parallelism against one process (CPU, gloo, fp32).

One 4-process launch (tests/helpers/mp_vpp.py) trains the dense proxy (4 layers: one per model
chunk) under PP=2 x VPP=2 x TP=2 on packed THD rows (several samples per row, so every chunk must
cut attention and the GDN scan at the right ``cu_seqlens``): with the distributed optimizer, and with
megatron's plain optimizer saving a checkpoint at step 2. In this process the same helper trains the
one-process model (megatron's no-pipelining schedule) and resumes the PP=2 x VPP=2 checkpoint under
PP=1. Each run starts from its own layout-independent init of the same seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DENSE = "configs/qwen35_vl_proxy.yaml"
STEPS = 3
ROWS = [f"train.iters={STEPS}", "checkpoint.dir=null", "model.attention_backend=sdpa", "model.gdn_backend=torch",
        "train.seq_length=256", "train.global_batch_size=2", "data.max_image_side=64", "data.max_text_tokens=48",
        "data.pad_multiple=2"]
DIST_OPT = "parallel.use_distributed_optimizer=true"
LAYOUT = "tp=2,pp=2,vpp=2"
LOSS_TOL = 1e-5  # per-token mean loss of a step
GRAD_NORM_RTOL = 2e-5


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _ranks(out: Path, n: int) -> list[dict]:
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(n)]


def _losses(record: dict) -> dict[int, float]:
    return {int(s): v["loss"][0] / v["loss"][1] for s, v in record["steps"].items()}


def _compare(ref: dict, got: dict, what: str) -> tuple[float, float]:
    lr, lg = _losses(ref), _losses(got)
    assert sorted(lg) == sorted(lr), (what, sorted(lg))
    dloss = max(abs(lg[s] - lr[s]) for s in lr)
    dgrad = max(abs(got["steps"][str(s)]["grad_norm"] / ref["steps"][str(s)]["grad_norm"] - 1) for s in lr)
    print(f"PARITY {what}: max |loss diff| {dloss:.3g}, max grad-norm rel diff {dgrad:.3g}")
    assert dloss <= LOSS_TOL, (what, lr, lg)
    assert dgrad <= GRAD_NORM_RTOL, (what, ref["steps"], got["steps"])
    return dloss, dgrad


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mcore):
    from megatron.core import parallel_state as ps

    from tests.helpers.mp_vpp import train

    tmp = tmp_path_factory.mktemp("vpp")
    _launch(tmp, [dict(out=str(tmp / "dist"), config=DENSE, layout=LAYOUT, overrides=[*ROWS, DIST_OPT]),
                  dict(out=str(tmp / "plain"), config=DENSE, layout=LAYOUT, overrides=ROWS, save_at=2)], nproc=4)
    try:
        ref = train(str(tmp / "ref"), DENSE, "pp=1", [*ROWS, DIST_OPT])
        resumed = train(str(tmp / "resumed"), DENSE, "pp=1", ROWS, load=str(tmp / "plain" / "ckpt" / "iter_0000002"))
    finally:
        ps.initialize_model_parallel(1, 1)  # the session's one-rank state, as the mcore fixture left it
    out = {"ref": ref, "resumed": resumed, "dist": _ranks(tmp / "dist", 4), "plain": _ranks(tmp / "plain", 4)}
    print("seconds per run:", {k: round((v[0] if isinstance(v, list) else v)["seconds"], 1) for k, v in out.items()})
    return out


def test_pp2_vpp2_tp2_trains_like_one_process(runs):
    """PP=2 x VPP=2 x TP=2 (interleaved schedule, distributed optimizer) logs the one-process losses
    and gradient norms step by step; each rank builds its two chunks' global layers."""
    dist = runs["dist"]
    assert all(r["schedule"] == "forward_backward_pipelining_with_interleaving" for r in dist)
    assert runs["ref"]["schedule"] == "forward_backward_no_pipelining"
    # rank order tp-pp: ranks 0,1 are pipeline rank 0 (layers 1 and 3), ranks 2,3 pipeline rank 1 (2 and 4)
    assert [r["layers"] for r in dist] == [[[1], [3]]] * 2 + [[[2], [4]]] * 2
    # one chunk per rank counts each micro-batch for the step's token and FLOP figures
    assert all(n == 2 for r in dist for n in r["batches"].values())
    last = dist[2]
    assert all(v["loss"] is None for v in dist[0]["steps"].values())  # the loss lives on the last stage
    _compare(runs["ref"], last, "pp=2 vpp=2 tp=2 + distributed optimizer")
    assert _losses(last)[STEPS] < _losses(last)[1]  # it trains
    # every grad norm is the same on all ranks (megatron reduces it over the model-parallel group)
    assert len({r["steps"][str(STEPS)]["grad_norm"] for r in dist}) == 1


def test_pp2_vpp2_checkpoint_resumes_under_pp1(runs):
    """A checkpoint saved at step 2 under PP=2 x VPP=2 x TP=2 (plain optimizer: its per-parameter
    state is stored under global keys) loads under PP=1 x TP=1, and the later steps log the losses the
    PP=2 x VPP=2 run logged after it, which are the one-process ones."""
    plain, resumed = runs["plain"][2], runs["resumed"]
    _compare(runs["ref"], plain, "pp=2 vpp=2 tp=2, plain optimizer")
    assert sorted(resumed["steps"]) == [str(s) for s in range(3, STEPS + 1)]
    cont = {"steps": {s: plain["steps"][s] for s in resumed["steps"]}}
    _compare(cont, resumed, "pp=2 vpp=2 tp=2 checkpoint resumed at pp=1")


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
