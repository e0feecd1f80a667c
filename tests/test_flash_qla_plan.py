"""The host-side planning around FlashQLA (fused_kernels/flash_qla_gdr.py): the chunk tables and the
intra-card split it is handed. The kernels themselves need an SM90 GPU:
tests/gpu/test_gdn_kernels_gpu.py runs them against fla and an fp32 reference."""

import pytest
import torch

from fused_kernels import flash_qla_gdr as qla
from fused_kernels.gated_delta_rule import chunk_indices_host


def test_chunk_table_matches_the_fla_table_and_counts_partial_chunks():
    cu = [0, 100, 164, 164, 1000]  # a partial chunk, an exact chunk, an empty sample, a long one
    offsets, total, indices = qla._chunk_table(cu)
    assert offsets.tolist() == [0, 2, 3, 3, 17]
    assert total == 17
    assert torch.equal(indices, chunk_indices_host(torch.tensor(cu)))


def test_split_cuts_only_segments_longer_than_the_piece_and_maps_both_ways():
    cu = [0, 300, 300, 1000]  # 5 chunks, empty, 11 chunks; pieces of 4 chunks = 256 tokens
    bounds, c2r, r2c, last, first = qla.split_pieces(cu, 4)
    assert bounds == [0, 256, 300, 300, 556, 812, 1000]
    assert c2r == [0, 0, 1, 2, 2, 2]
    assert r2c == [0, 2, 3, 6]
    assert last == [False, True, True, False, False, True]
    assert first == [True, False, True, True, False, False]


def test_split_of_short_segments_is_one_piece_each():
    cu = [0, 64, 128, 200]
    bounds, c2r, r2c, last, first = qla.split_pieces(cu, 4)
    assert bounds == cu and c2r == [0, 1, 2] and r2c == [0, 1, 2, 3]
    assert all(last) and all(first)


def test_backend_name_is_checked():
    import pytest

    from fused_kernels.gated_delta_rule import gdn_backend

    from core.errors import ConfigError

    with pytest.raises(ConfigError, match="gdn_backend=flash_qla cannot run"):
        gdn_backend("flash_qla")  # no CUDA here


def _stand_in_flash_qla(monkeypatch):
    """The one FlashQLA name the planning code builds (its context dataclass), without FlashQLA,
    which needs an SM90 GPU to import."""
    import dataclasses
    import sys
    import types

    @dataclasses.dataclass
    class FlashQLACPContext:
        is_intra: bool = False
        cu_seqlens: torch.Tensor | None = None
        intra_cp_cu_seqlens: torch.Tensor | None = None
        seq_map_r2c: torch.Tensor | None = None
        seq_map_c2r: torch.Tensor | None = None
        ht_mask: torch.Tensor | None = None
        ht_mask_bwd: torch.Tensor | None = None

    cp = types.ModuleType("flash_qla.ops.gated_delta_rule.chunk.cp")
    cp.FlashQLACPContext = FlashQLACPContext
    monkeypatch.setitem(sys.modules, "flash_qla.ops.gated_delta_rule.chunk.cp", cp)


def test_graph_plan_recomputes_the_chunk_offsets_of_each_loaded_row(monkeypatch):
    """layer_graphs.StaticBatch.load copies a row's cu_seqlens into the static buffer; the
    multi-sample plan must then hand FlashQLA that row's chunk offsets (device ops only), the
    chunk table the graphs keep, and a chunk count that bounds every row."""
    _stand_in_flash_qla(monkeypatch)
    seq, max_samples = 1024, 4
    cu64 = torch.full((max_samples + 2,), seq, dtype=torch.int64)
    chunks = torch.zeros((seq // qla.CHUNK + max_samples, 2), dtype=torch.int64)
    plan = qla.StaticPlan(cu64, chunks, seq, heads=16, one_segment=False)
    assert not plan.plan.context.is_intra and plan.plan.cu_seqlens is cu64
    for row in ([0, 100, 164, 1024], [0, 1024], [0, 1, 2, 3, 1024]):
        cu64[: len(row)] = torch.tensor(row)
        cu64[len(row):] = seq
        plan.load()
        prepared = cu64._flash_qla_prepared_varlen
        offsets, total, _ = qla._chunk_table(cu64.tolist())
        assert prepared[0] == qla.CHUNK and prepared[3] is chunks
        assert torch.equal(prepared[1], offsets), row
        assert prepared[2] == chunks.shape[0] >= total


def test_one_sample_graph_plan_is_the_split_of_the_whole_row(monkeypatch):
    _stand_in_flash_qla(monkeypatch)
    monkeypatch.setattr(qla, "decide_split", lambda cu, heads: 16)  # FlashQLA's choice, stubbed
    seq, max_samples = 8192, 3
    cu64 = torch.full((max_samples + 2,), seq, dtype=torch.int64)
    cu64[0] = 0
    chunks = torch.zeros((seq // qla.CHUNK + max_samples, 2), dtype=torch.int64)
    ctx = qla.StaticPlan(cu64, chunks, seq, heads=16, one_segment=True).plan.context
    assert ctx.is_intra and ctx.cu_seqlens is cu64
    # 8 pieces of 1024 tokens, then one empty piece per empty padding segment
    assert ctx.intra_cp_cu_seqlens.tolist() == list(range(0, seq, 1024)) + [seq] * 4
    assert ctx.seq_map_c2r.tolist() == [0] * 8 + [1, 2, 3]
    assert ctx.seq_map_r2c.tolist() == [0, 8, 9, 10, 11]
    assert ctx.ht_mask.tolist() == [False] * 7 + [True] * 4
    assert ctx.ht_mask_bwd.tolist() == [True] + [False] * 7 + [True] * 3
    pieces_table = ctx.intra_cp_cu_seqlens._flash_qla_prepared_varlen
    assert pieces_table[2] == 128 and pieces_table[1].tolist() == [16 * i for i in range(9)] + [128] * 3


def test_eager_rows_plan_lazily_from_their_host_boundaries_once(monkeypatch):
    """The trainer's GDNVarlen keeps the host cu_seqlens; the first FlashQLA call plans from them
    (no device read), later layers reuse that plan, and a plan given up front (the graphs') wins."""
    from fused_kernels.gated_delta_rule import GDNVarlen

    calls = []

    def fake_plan(cu_host, cu_dev, heads):
        calls.append((cu_host.tolist(), cu_dev.device.type, heads))
        return ("plan", heads)

    monkeypatch.setattr(qla, "plan_from_host", fake_plan)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    varlen = GDNVarlen.from_host(cu, "cpu")
    assert calls == []  # nothing planned for backends that never ask
    assert varlen.flash_qla_plan(16) == ("plan", 16)
    assert varlen.flash_qla_plan(16) == ("plan", 16)
    assert calls == [([0, 100, 300], "cpu", 16)]
    assert varlen.flash_qla_plan(8) == ("plan", 8)  # another head count gets its own plan
    assert varlen.flash_qla_plan(16) == ("plan", 16)
    assert [c[2] for c in calls] == [16, 8]
    fixed = GDNVarlen(varlen.cu_seqlens, varlen.chunk_indices, qla="static plan", qla_heads=16)
    assert fixed.flash_qla_plan(16) == "static plan"
    with pytest.raises(ValueError, match="made for 16 heads, this GDN layer has 8"):
        fixed.flash_qla_plan(8)
    assert GDNVarlen(varlen.cu_seqlens, varlen.chunk_indices).flash_qla_plan(16) is None


def test_graphs_find_the_flash_qla_head_count_in_the_layers():
    from models.qwen35_vl.layer_hooks import flash_qla_heads

    class GDN(torch.nn.Module):
        def __init__(self, backend):
            super().__init__()
            self.kernel_backend, self.num_v_heads_local_tp = backend, 16

    def layers(backend):
        return [torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Sequential(GDN(backend))]

    assert flash_qla_heads(layers("flash_qla")) == 16
    assert flash_qla_heads(layers("fla")) is None
