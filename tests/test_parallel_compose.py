"""Context parallelism composed with the other layouts, against one process (CPU, gloo, fp32):
TP=2 with sequence parallelism x CP=2 and PP=2 x CP=2 on four processes, EP=2 x CP=2 (the
experts split over the context-parallel ranks) on two. Same init weights, same packed rows
(every sample padded to a multiple of 8, what tp=2 x cp=2 with SP needs), same per-step losses."""

from __future__ import annotations

import pytest

from test_parallel import DENSE, MOE, PACKED, _compare, _run, _save_init_weights

ROWS = [o for o in PACKED if not o.startswith("data.loader.pad_multiple")] + ["data.loader.pad_multiple=8"]
# tp*cp = 4 must divide the GDN key heads (per TP rank, heads are then split over CP)
HEADS = ["model.linear_num_key_heads=4", "model.linear_num_value_heads=8"]


@pytest.fixture(scope="module")
def dense(tmp_path_factory, mcore):
    init = _save_init_weights(tmp_path_factory.mktemp("init"), DENSE, HEADS)
    return init, _run(tmp_path_factory.mktemp("ref"), DENSE, *ROWS, *HEADS, f"checkpoint.load={init}")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2"],
    ["parallel.pp=2", "parallel.cp=2"],
], ids=["tp2_sp_cp2", "pp2_cp2"])
def test_cp_composes_with_tp_and_pp(tmp_path, dense, layout):
    init, ref = dense
    got = _run(tmp_path, DENSE, *ROWS, *HEADS, f"checkpoint.load={init}", *layout, nproc=4)
    _compare(ref, got, "+".join(layout), world=4)


@pytest.mark.slow
def test_cp2_with_experts_split_over_cp_ranks(tmp_path_factory, mcore):
    init = _save_init_weights(tmp_path_factory.mktemp("moe_init"), MOE, [])
    ref = _run(tmp_path_factory.mktemp("moe_ref"), MOE, *ROWS, f"checkpoint.load={init}")
    got = _run(tmp_path_factory.mktemp("moe_cp"), MOE, *ROWS, f"checkpoint.load={init}", "parallel.cp=2",
               "parallel.ep=2", nproc=2)
    _compare(ref, got, "cp2+ep2 (MoE)")
