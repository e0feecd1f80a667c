"""The layouts a 397B run composes, on 8 CPU processes (gloo, fp32), against one process.

One 8-process launch (tests/helpers/mp_vpp.py: the processes start once, then train each run in
turn) trains, 4 steps each, with megatron's distributed optimizer:

- dense proxy, PP=2 x VPP=2 x TP=2 (sequence parallel) x DP=2 (interleaved 1F1B schedule), saving
  a checkpoint at step 2; and the same layout with the plain optimizer (its checkpoint loads under
  any layout: it is resumed here at PP=1);
- MoE proxy, PP=2 x CP=2 x EP=2 (DP=2; the experts split over DP x CP);
- MoE proxy, TP=2 (sequence parallel) x EP=2 with expert TP=2 (megatron's expert TP follows
  ``parallel.tp``): DP=4, expert DP=2.

Every model trains one MTP depth: its input embeddings (image features included) travel from the
first pipeline stage to the last after the hidden states, and its loss (``mtp_loss``) must agree
too.

In this process the Trainer trains one reference per proxy (megatron's no-pipelining schedule),
shared by the runs of that proxy. Every run starts from its own layout-independent init of the same
seed. Each step's loss must agree within 1e-5 and its gradient norm within 1e-5 relative, with the
same supervised tokens, tokens and FLOPs (counted once per model replica).

Rows: with DP = d, rank r packs samples r, r+d, ... into its own rows, so a step covers the samples
a one-process step covers only if every row holds a fixed number of samples, in order. The dense
rows hold exactly two (so every virtual stage must cut attention and the GDN scan at the right
``cu_seqlens``); the MoE rows exactly one, since the router's load-balancing loss couples the
tokens of a micro-batch (the same micro-batches, not only the same samples, are needed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_parallel import DENSE, MOE, STEPS, _free_port
from test_parallel import _compare as compare_runs

ROOT = Path(__file__).resolve().parents[1]
COMMON = [f"train.iters={STEPS}", "checkpoint.dir=null", "model.attention_backend=sdpa", "model.gdn_backend=torch",
          "logging.progress_bar=false", "logging.tensorboard=false", "train.global_batch_size=4",
          "data.mock.max_images=1", "data.mock.max_image_side=64", "data.mock.min_text_tokens=24",
          "data.mock.max_text_tokens=32", "data.loader.pad_multiple=4", "data.loader.pack_lookahead=0",
          # the MTP head on the last stage, its input embeddings sent from the first (models/base.py)
          "model.mtp_num_layers=1"]
# samples padded to 4 are 40-52 tokens long (checked below): 2 always fit in 112, 3 never;
# 1 always fits in 64, 2 never
TWO_PER_ROW, ONE_PER_ROW = 112, 64
DENSE_ROWS = [*COMMON, f"train.seq_length={TWO_PER_ROW}"]
MOE_ROWS = [*COMMON, f"train.seq_length={ONE_PER_ROW}"]
DIST_OPT = "parallel.use_distributed_optimizer=true"
WORLD = 8
LAYOUTS = {
    "pp2_vpp2_tp2_dp2": (DENSE, ["parallel.pp=2", "parallel.vpp=2", "parallel.tp=2",
                                 "parallel.sequence_parallel=true"]),
    "pp2_cp2_ep2": (MOE, ["parallel.pp=2", "parallel.cp=2", "parallel.ep=2"]),
    "tp2_ep2_etp2": (MOE, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"]),
}
LOSS_TOL = 1e-5  # the logged (per-token mean) loss of a step
GRAD_NORM_RTOL = 1e-5  # TP=2 sums in another order: measured up to 6e-6 (docs/parallelism.md)


def _rows(config: str) -> list[str]:
    return DENSE_ROWS if config == DENSE else MOE_ROWS


def _launch(tmp: Path, runs: list[dict], nproc: int) -> None:
    """``runs`` ({"config", "overrides"}) trained in turn by one torchrun launch of ``nproc`` processes."""
    spec = tmp / "runs.json"
    spec.write_text(json.dumps(runs))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                           f"--master-port={_free_port()}", "tests/helpers/mp_vpp.py", str(spec)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _metrics(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _compare(ref: dict, got: dict, what: str, world: float = WORLD, whole_run: bool = True) -> tuple[float, float]:
    return compare_runs(ref, got, what, world, LOSS_TOL, GRAD_NORM_RTOL, whole_run=whole_run)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mcore):
    from tests.helpers.mp_vpp import train_in_process

    tmp = tmp_path_factory.mktemp("p8")
    ckpt = ["checkpoint.interval=2"]
    launch = [dict(config=config, overrides=[*_rows(config), *layout, DIST_OPT, f"logging.dir={tmp / name}"])
              for name, (config, layout) in LAYOUTS.items()]
    launch[0]["overrides"] += [*ckpt, f"checkpoint.dir={tmp / 'dense_ckpt'}"]
    plain = [*DENSE_ROWS, *LAYOUTS["pp2_vpp2_tp2_dp2"][1], *ckpt, f"checkpoint.dir={tmp / 'plain_ckpt'}"]
    launch.append(dict(config=DENSE, overrides=[*plain, f"logging.dir={tmp / 'plain'}"]))
    _launch(tmp, launch, nproc=WORLD)
    for name, config in (("dense_ref", DENSE), ("moe_ref", MOE)):
        train_in_process(config, [*_rows(config), DIST_OPT, f"logging.dir={tmp / name}"])
    train_in_process(DENSE, [*DENSE_ROWS, f"logging.dir={tmp / 'resumed'}",
                             f"checkpoint.load={tmp / 'plain_ckpt' / 'iter_0000002'}"])
    names = [*LAYOUTS, "plain", "dense_ref", "moe_ref", "resumed"]
    return {**{k: _metrics(tmp / k) for k in names}, "tmp": tmp}


@pytest.mark.parametrize("config, seq, per_row", [(DENSE, TWO_PER_ROW, 2), (MOE, ONE_PER_ROW, 1)])
def test_every_row_holds_a_fixed_number_of_samples(config, seq, per_row):
    """The comparisons across data-parallel sizes are honest only if every packed row of the samples
    the runs read (4 steps of 4 rows, the resumed steps included) holds exactly ``per_row`` samples."""
    from data.collate import padded_length
    from data.loader import build_dataset
    from multimodal.config import load_config

    cfg = load_config(config, _rows(config))
    ds = build_dataset(cfg.model, cfg.data, seq)
    lengths = [padded_length(len(ds[i]["input_ids"]), 4) for i in range(4 * STEPS * per_row + 8)]
    assert per_row * max(lengths) <= seq < (per_row + 1) * min(lengths), lengths


@pytest.mark.slow
def test_pp2_vpp2_tp2_dp2_trains_like_one_process(runs):
    """Dense proxy, interleaved pipeline x TP with sequence parallelism x DP, two samples per row,
    with the distributed optimizer and with megatron's plain one."""
    ref = runs["dense_ref"]
    _compare(ref, runs["pp2_vpp2_tp2_dp2"], "pp=2 vpp=2 tp=2 sp dp=2 + distributed optimizer")
    _compare(ref, runs["plain"], "pp=2 vpp=2 tp=2 sp dp=2")


@pytest.mark.slow
def test_pp2_cp2_ep2_moe_trains_like_one_process(runs):
    """MoE proxy: MoE layers (and their aux loss) on both pipeline stages, untied embedding and
    output layer, every sample cut into 2·CP zigzag chunks, the experts split over two of the DP x CP
    ranks, dense and expert parameters in the distributed optimizer's two sets of buffers."""
    _compare(runs["moe_ref"], runs["pp2_cp2_ep2"], "pp=2 cp=2 ep=2 (MoE) + distributed optimizer")


@pytest.mark.slow
def test_tp2_ep2_expert_tp2_moe_trains_like_one_process(runs):
    """MoE proxy: every expert split over the two TP ranks and the experts over two EP ranks; the
    dispatcher all-gathers / reduce-scatters a different number of tokens per TP rank after the
    all-to-all (on CPU gloo gathers equal shapes only: multimodal/platform.py pads them)."""
    _compare(runs["moe_ref"], runs["tp2_ep2_etp2"], "tp=2 sp ep=2 etp=2 (MoE) + distributed optimizer")


@pytest.mark.slow
def test_pp2_vpp2_checkpoint_resumes_under_pp1(runs):
    """A checkpoint saved at step 2 under PP=2 x VPP=2 x TP=2 x DP=2 (plain optimizer: its state is
    stored under global keys) loads in one process, the data order continues from the DP=2 ranks'
    frontier, and steps 3-4 log the losses the 8-process run logged."""
    resumed = runs["resumed"]
    assert sorted(resumed) == [3, 4]
    _compare(runs["plain"], resumed, "pp=2 vpp=2 tp=2 dp=2 checkpoint resumed at pp=1", world=1 / WORLD,
             whole_run=False)


@pytest.mark.slow
def test_distributed_optimizer_checkpoint_under_another_layout_is_refused_in_one_line(runs):
    """The distributed optimizer's state is stored per gradient bucket of the layout it ran under:
    loading it under PP=1 stops before any tensor is read, naming both layouts and the fix."""
    from core.errors import CheckpointError
    from tests.helpers.mp_vpp import train_in_process

    tmp = runs["tmp"]
    with pytest.raises(CheckpointError) as err:
        train_in_process(DENSE, [*DENSE_ROWS, DIST_OPT, f"logging.dir={tmp / 'refused'}",
                                 f"checkpoint.load={tmp / 'dense_ckpt' / 'iter_0000002'}"])
    msg = str(err.value)
    assert "tp=2 pp=2 vpp=2 ep=1" in msg and "this run is tp=1 pp=1 vpp=1 ep=1" in msg and "\n" not in msg, msg



class _TwoRanks:
    """Two ranks of gloo in one process: each rank's call runs twice, first recording the tensor it
    contributes to the collective, then completing it with the other rank's. As gloo does, the
    collective refuses tensors of different shapes."""

    def __init__(self):
        self.sent: dict[int, torch.Tensor] = {}
        self.me = 0

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return self.me

    def _both(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        self.sent[self.me] = tensor.clone()
        if len(self.sent) < 2:
            return None
        assert self.sent[0].shape == self.sent[1].shape, "gloo: invalid tensor size"
        return [self.sent[0], self.sent[1]]

    def all_gather_into_tensor(self, out, tensor, group):
        if (both := self._both(tensor)) is not None:
            out.copy_(torch.cat(both))

    def reduce_scatter_tensor(self, out, tensor, group):
        if (both := self._both(tensor)) is not None:
            out.copy_((both[0] + both[1]).chunk(2)[self.me])

    def run(self, fn, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """fn(inputs[r], group) on ranks 0 and 1; the second pass sees the collective complete."""
        self.sent.clear()
        for _ in range(2):
            outs = []
            for self.me in (0, 1):
                outs.append(fn(inputs[self.me], self))
        return outs


def test_uneven_expert_tp_gather_and_reduce_scatter_keep_megatrons_result(monkeypatch):
    """megatron's dispatcher under expert TP with EP > 1 all-gathers a different number of token
    rows from each TP rank and reduce-scatters them back (what failed under TP=2 x EP=2 on gloo:
    'invalid tensor size'). The CPU patch pads every rank's rows to the largest count: the gather
    is still every rank's rows in rank order, the reduce-scatter each rank's own rows of the sum."""
    from multimodal import platform

    ranks = _TwoRanks()
    monkeypatch.setattr(platform.dist, "all_gather_into_tensor", ranks.all_gather_into_tensor)
    monkeypatch.setattr(platform.dist, "reduce_scatter_tensor", ranks.reduce_scatter_tensor)
    equal_sizes = []  # megatron's own function handles equal shards (no split sizes)
    gather = platform._gather_rows_padded(lambda *a: equal_sizes.append(a))
    reduce_scatter = platform._reduce_scatter_rows_padded(lambda *a: equal_sizes.append(a))

    sizes = [3, 5]
    rows = [torch.randn(n, 4) for n in sizes]
    for out in ranks.run(lambda x, g: gather(x, g, sizes), rows):
        assert torch.equal(out, torch.cat(rows))
    full = [torch.randn(8, 4) for _ in (0, 1)]  # each rank's [rows for rank 0 | rows for rank 1]
    total = (full[0] + full[1]).split(sizes)
    for r, out in enumerate(ranks.run(lambda x, g: reduce_scatter(x, g, sizes), full)):
        assert torch.equal(out, total[r]), r
    assert not equal_sizes
    gather(rows[0], ranks)
    reduce_scatter(full[0], ranks)
    assert len(equal_sizes) == 2
