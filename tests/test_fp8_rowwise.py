"""FP8's power-of-two (rowwise and experts') casts in Triton (fused_kernels/fp8_rowwise.py): the kernels
against their PyTorch references under Triton's CPU interpreter, the rowwise linear and the experts'
grouped GEMMs wired through them (the references standing in for the kernels, torch's FP8 GEMMs
written out) against the emulated path, and, on a GPU, the kernels bit-exact against the references
and the compiled casts they replace."""

from __future__ import annotations

import pytest
import torch

from fused_kernels import fp8_rowwise as rw
from fused_kernels import fp8_token_groups as tg
from models.common import fp8, fp8_gemm
from tests.helpers.fp8_cases import linear_case, run_interpreted, scaled_mm_emulated

# Rows: several column blocks (256) with a ragged edge, one row, no rows; row-major, column-major and
# a column slice. Columns (expert weights [G, K, M]): ragged K and M blocks (64), contiguous and
# transposed in memory. Each with its own amax and with a given one (a TP all-reduce's). The
# interpreter's fp32 -> fp8 conversion does not round to nearest even as the GPU's does, so the casts
# write fp16 here (its largest finite value sets the scales); the fp8 store is checked on the GPU.
# Then the scales alone for every positive bf16 value below 1.4e38, as one-element rows, in e4m3
# and e5m2: the kernels' mantissa mask against torch's exp2(floor(log2(.))).
_INTERP_CHECK = """
import json, torch
from fused_kernels import fp8_rowwise as rw
out = []
for n, cols in [(37, 300), (8, 256), (1, 5), (0, 16), (20, 1000)]:
    torch.manual_seed(n + cols)
    x = (torch.randn(n, cols) * torch.logspace(-3, 2, cols)).to(torch.bfloat16)
    for v in (x, x.t().contiguous().t(), torch.cat([x, x], 1)[:, :cols]):
        amax = rw.row_amax(v)
        checks = [torch.equal(amax, v.abs().float().amax(1, keepdim=True)) if n else amax.shape == (0, 1)]
        for given in (None, amax * 2):
            got, want = rw.cast_rows(v, torch.float16, given), rw.cast_rows_reference(v, torch.float16, given)
            checks += [torch.equal(a, b) for a, b in zip(got, want)] + [got[0].is_contiguous()]
        out.append(["rows", n, cols, [bool(c) for c in checks]])
for g, k, m in [(3, 100, 70), (2, 64, 64), (1, 5, 3), (4, 130, 200)]:
    torch.manual_seed(g + k + m)
    w = (torch.randn(g, k, m) * torch.logspace(-2, 2, m)).to(torch.bfloat16)
    for v in (w, w.mT.contiguous().mT):
        amax = rw.column_amax(v)
        checks = [torch.equal(amax, v.abs().float().amax(1, keepdim=True))]
        for given in (None, amax / 3):
            got, want = rw.cast_columns(v, torch.float16, given), rw.cast_columns_reference(v, torch.float16, given)
            checks += [torch.equal(a, b) for a, b in zip(got, want)] + [got[0].stride() == (m * k, 1, k)]
        out.append(["columns", g, k, m, [bool(c) for c in checks]])
rw.ROWS_BLOCK_ROWS = 512  # 32K one-element rows: fewer, larger programs under the interpreter
values = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
values = values[values.float() < 1.4e38].reshape(-1, 1)
scales = [values.shape[0]]
for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
    scales.append(bool(torch.equal(rw.cast_rows(values, dtype)[1], rw.cast_rows_reference(values, dtype)[1])))
out.append(scales)
print(json.dumps(out))
"""


def test_rowwise_kernels_equal_their_references_under_the_interpreter():
    *rows, scales = run_interpreted(_INTERP_CHECK)
    assert len(rows) == 15 + 8
    for row in rows:
        assert all(row[-1]) and len(row[-1]) == 7, row
    assert scales == [32466, True, True]  # every positive finite bf16 value below 1.4e38


def _scaled_grouped_mm_emulated(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum):
    """torch._scaled_grouped_mm's 2D x 3D form written out: a [N, K] (scale_a [N]) by b [G, K, M]
    (scale_b [G, M]), each group of a's rows by its expert's matrix."""
    out, start = torch.zeros(a.shape[0], b.shape[2]), 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = (a[start:end].float() * scale_a[start:end, None]) @ (b[g].float() * scale_b[g][None, :])
        start = end
    return out.to(out_dtype)


def _kernels_replaced_by_references(monkeypatch) -> dict:
    """The fast path on the CPU: the kernels' references stand in for them, torch's FP8 GEMMs are
    written out; returns the calls of each kernel (input shape, contiguous)."""
    calls = {"rows": [], "row_amax": [], "columns": [], "column_amax": [], "transposed": []}

    def spy(name, fn):
        return lambda x, *a, **k: calls[name].append((tuple(x.shape), x.is_contiguous())) or fn(x, *a, **k)

    monkeypatch.setattr(fp8_gemm, "fast_path_reason", lambda *a, **k: None)
    monkeypatch.setattr(rw, "available", lambda x: None)
    monkeypatch.setattr(rw, "cast_rows", spy("rows", rw.cast_rows_reference))
    monkeypatch.setattr(rw, "row_amax", spy("row_amax", lambda x: x.abs().float().amax(1, keepdim=True)))
    monkeypatch.setattr(rw, "cast_columns", spy("columns", rw.cast_columns_reference))
    monkeypatch.setattr(rw, "column_amax", spy("column_amax", lambda x: x.abs().float().amax(1, keepdim=True)))
    monkeypatch.setattr(tg, "available", lambda x: None)
    monkeypatch.setattr(tg, "column_amax", spy("column_amax", tg.column_amax_reference))
    monkeypatch.setattr(tg, "cast_transposed", spy("transposed", tg.cast_transposed_reference))
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_emulated)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _scaled_grouped_mm_emulated)
    return calls


def test_rowwise_linear_through_the_kernels_equals_the_emulated_one(monkeypatch):
    """``_Fp8Linear`` under ``rowwise`` with its casts through the Triton kernels' forms (references
    standing in) against the emulated path: the same output and input gradient, a weight gradient
    equal up to the padded contraction's summation order; with GDN's high-precision tail rows too."""
    run = linear_case("rowwise")
    emulated = [run(h, False) for h in (0, 16)]
    calls = _kernels_replaced_by_references(monkeypatch)
    for hp_rows, (out_e, dw_e, dx_e) in zip((0, 16), emulated):
        out, dw, dx = run(hp_rows, False)
        torch.testing.assert_close(out, out_e, rtol=0, atol=0)
        torch.testing.assert_close(dx, dx_e, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dw, dw_e, rtol=1e-2, atol=1e-3)
    # per linear: x, the weight and the gradient per row; the weight per column (transposed) for the
    # input gradient; x and the gradient per column over the tokens (token-major) for the weight's
    assert calls["rows"][3:6] == [((1000, 64), True), ((80, 64), True), ((1000, 80), False)]
    assert len(calls["rows"]) == 6 and not calls["row_amax"] and not calls["columns"]
    assert calls["transposed"][3:6] == [((80, 64), True), ((1000, 80), False), ((1000, 64), True)]


def test_expert_gemms_through_the_kernels_equal_the_emulated_ones(monkeypatch):
    """The routed experts' two 3-D GEMM forms (forward: x by w1^T, whose per-column scales run along
    w1's contiguous rows; input gradient: g by w2, transposed by its cast) through the kernels'
    forms against the emulated path; also with the contraction's amax given (expert TP)."""
    gen = torch.Generator().manual_seed(0)
    offs = torch.tensor([100, 100, 517, 1000], dtype=torch.int32)  # an empty expert
    x = torch.randn(1000, 64, generator=gen).bfloat16()
    w1 = (torch.randn(4, 96, 64, generator=gen) * 0.05).bfloat16()  # [E, 2F, H]
    g = torch.randn(1000, 48, generator=gen).bfloat16()
    w2 = (torch.randn(4, 48, 32, generator=gen) * 0.05).bfloat16()  # [E, H, F]
    emulated = [fp8.grouped_mm(x, w1.mT, offs), fp8.grouped_mm(g, w2, offs)]
    calls = _kernels_replaced_by_references(monkeypatch)
    fast = [fp8.grouped_mm(x, w1.mT, offs), fp8.grouped_mm(g, w2, offs)]
    for got, want in zip(fast, emulated):
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-6, atol=1e-6)
    # x, w1 as the rows of its [E*2F, H] memory, g; w2 transposed by the column kernel
    assert calls["rows"] == [((1000, 64), True), ((384, 64), True), ((1000, 48), True)]
    assert calls["columns"] == [((4, 48, 32), True)]

    class _OneRankGroup:  # a contraction group of one: the all-reduce is the identity
        def size(self):
            return 2

    monkeypatch.setattr(fp8_gemm.dist, "all_reduce", lambda *a, **k: None)
    split = [fp8.grouped_mm(x, w1.mT, offs, _OneRankGroup()), fp8.grouped_mm(g, w2, offs, _OneRankGroup())]
    for got, want in zip(split, emulated):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-6, atol=1e-6)
    assert len(calls["row_amax"]) == 3 and len(calls["column_amax"]) == 1


@pytest.mark.gpu
def test_rowwise_kernels_are_bit_exact_on_the_gpu():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(9013, 2100, device="cuda", generator=gen) * 3).bfloat16()
    w = (torch.randn(8, 1024, 520, device="cuda", generator=gen) * 0.02).bfloat16()
    for dtype in (fp8_gemm.E4M3, fp8_gemm.E5M2):
        for v in (x, x.t().contiguous().t(), x[:, :2048]):
            got, want = rw.cast_rows(v, dtype), rw.cast_rows_reference(v, dtype)
            assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
            compiled, inv = fp8_gemm._kernel(fp8_gemm._quantize, v)(v, -1, dtype, True, False)
            assert torch.equal(got[0].view(torch.uint8), compiled.view(torch.uint8)) and torch.equal(got[1], inv)
        for v in (w, w.mT.contiguous().mT):
            got, want = rw.cast_columns(v, dtype), rw.cast_columns_reference(v, dtype)
            assert got[0].stride() == want[0].stride()
            assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
            compiled, inv = fp8_gemm._kernel(fp8_gemm._quantize, v)(v, -2, dtype, True, True)
            assert torch.equal(got[0].view(torch.uint8), compiled.view(torch.uint8)) and torch.equal(got[1], inv)
