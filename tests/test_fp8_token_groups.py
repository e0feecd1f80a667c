"""The FP8 quantization of the routed experts' weight-gradient operands (fused_kernels/fp8_token_groups.py):
the two Triton kernels against their PyTorch references under Triton's CPU interpreter, the fast
path's plumbing (padded offsets, scale layout, the grouped GEMM's operands) against the emulated
FP8 path, and, on a GPU, the kernels bit-exact in e4m3."""

from __future__ import annotations

import pytest
import torch

from fused_kernels import fp8_token_groups as tg
from models.common import fp8, fp8_gemm
from tests.helpers.fp8_cases import linear_case, run_interpreted, scaled_mm_emulated

# Cases: an empty group and rows past the last offset; two small groups; leading empty groups;
# no group at all; groups of several chunks (CHUNK_ROWS = 512), whose amax meet through atomics. Each with a row-major input and a column-major one (the a operand is g.mT.mT).
# The interpreter's fp32 -> fp8 conversion does not round to nearest even as the GPU's does, so
# on the CPU the cast kernel writes fp32 (the same program, its last conversion a no-op): that
# checks the grouping, padding, scales and layout bit for bit; the e4m3 store is checked on the GPU.
_INTERP_CHECK = """
import json, torch
from fused_kernels import fp8_token_groups as tg
out = []
for counts, cols, tail in [([100, 0, 417, 473], 96, 10), ([5, 3], 40, 0), ([0, 0, 64], 64, 3), ([], 16, 4),
                          ([1300, 0, 700], 80, 5)]:
    torch.manual_seed(len(counts) + cols)
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    n = (int(offs[-1]) if counts else 0) + tail
    x = (torch.randn(n, cols) * torch.logspace(-3, 2, cols)).to(torch.bfloat16)
    new_offs, width = tg.padded_offsets(offs, n)
    for v in (x, x.t().contiguous().t()):
        assert tg.available(v) is None
        amax = tg.group_amax(v, offs)
        scale = 448.0 / tg.group_amax_reference(v, offs).clamp(min=1e-12)
        got = tg.cast_groups_transposed(v, offs, new_offs, width, scale, torch.float32)
        want = tg.cast_groups_transposed_reference(v, offs, new_offs, width, scale, torch.float32)
        out.append([n, cols, bool(torch.equal(amax, tg.group_amax_reference(v, offs))), bool(torch.equal(got, want)),
                    list(got.shape)])
dense = []
for n, cols in [(1000, 96), (1300, 40), (32, 64), (0, 16)]:  # one chunk padded, several chunks, aligned, empty
    torch.manual_seed(n + cols)
    x = (torch.randn(n, cols) * torch.logspace(-3, 2, cols)).to(torch.bfloat16)
    for v in (x, x.t().contiguous().t()):
        amax = tg.column_amax(v)
        want_amax = tg.column_amax_reference(v)
        for scale in (448.0 / want_amax.clamp(min=1e-12), torch.tensor(0.37)):
            got = tg.cast_transposed(v, scale, torch.float32)
            want = tg.cast_transposed_reference(v, scale, torch.float32)
            dense.append([n, cols, bool(torch.equal(amax, want_amax)), bool(torch.equal(got, want)), list(got.shape)])
print(json.dumps([out, dense]))
"""


def test_token_group_kernels_equal_their_references_under_the_interpreter():
    rows, dense = run_interpreted(_INTERP_CHECK)
    assert len(rows) == 10 and len(dense) == 16
    for n, cols, amax_equal, cast_equal, shape in rows:
        assert amax_equal and cast_equal, (n, cols)
    # padded width: round_up(N, 16) + 16 per group
    assert [r[4] for r in rows[::2]] == [[96, 1008 + 64], [40, 16 + 32], [64, 80 + 48], [16, 16], [80, 2016 + 48]]
    # one group (a dense weight gradient): both scale forms, padded only to round_up(N, 16)
    for n, cols, amax_equal, cast_equal, shape in dense:
        assert amax_equal and cast_equal, (n, cols)
    assert [r[4] for r in dense[::4]] == [[96, 1008], [40, 1312], [64, 32], [16, 0]]


def test_dense_reference_layout_puts_the_padding_after_the_rows():
    x = torch.tensor([[1.0, -2.0], [3.0, 4.0], [-5.0, 0.5]])
    out = tg.cast_transposed_reference(x, torch.tensor([[2.0, 10.0]]), torch.float32)
    want = torch.zeros(2, 16)
    want[:, :3] = torch.tensor([[2.0, 6.0, -10.0], [-20.0, 40.0, 5.0]])
    assert torch.equal(out, want)
    assert torch.equal(tg.column_amax_reference(x), torch.tensor([[5.0, 4.0]]))


def test_reference_layout_puts_each_group_on_a_16_token_boundary():
    """Hand-checked: groups of 3 and 0 and 2 tokens, one token in no group."""
    offs = torch.tensor([3, 3, 5], dtype=torch.int32)
    new_offs, width = tg.padded_offsets(offs, 6)
    assert new_offs.tolist() == [16, 16, 32] and width == 16 + 48
    x = torch.arange(1, 13, dtype=torch.float32).reshape(6, 2)  # rows 1..6: [2n-1, 2n]
    scale = torch.tensor([[1.0, 2.0], [5.0, 5.0], [10.0, 100.0]])
    out = tg.cast_groups_transposed_reference(x, offs, new_offs, width, scale, torch.float32)
    want = torch.zeros(2, width)
    want[:, 13:16] = torch.tensor([[1.0, 3.0, 5.0], [4.0, 8.0, 12.0]])  # group 0 ends at 16: padding before
    want[:, 30:32] = torch.tensor([[70.0, 90.0], [800.0, 1000.0]])  # group 2 ends at 32
    assert torch.equal(out, want)  # the sixth row is in no group: not written
    assert torch.equal(tg.group_amax_reference(x, offs), torch.tensor([[5.0, 6.0], [0.0, 0.0], [9.0, 10.0]]))


def _scaled_grouped_mm_emulated(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum):
    """torch._scaled_grouped_mm's 2D x 2D form written out: a [M, W] and b [W, K] with W grouped
    by offs, scale_a [G*M] and scale_b [G*K]; out[g] = (a_g * sa_g) @ (b_g * sb_g)."""
    groups, m, k = offs.numel(), a.shape[0], b.shape[1]
    sa, sb = scale_a.reshape(groups, m), scale_b.reshape(groups, k)
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        out.append((a[:, start:end].float() * sa[g][:, None]) @ (b[start:end].float() * sb[g][None, :]))
        start = end
    return torch.stack(out).to(out_dtype)


def test_fast_weight_gradient_path_equals_the_emulated_one(monkeypatch):
    """fp8.grouped_mm's weight-gradient form through the fused path (its kernels' references
    standing in for them, torch's grouped GEMM written out) against the emulated FP8 path: the
    same quantized operands in the padded layout give the same per-expert products."""
    gen = torch.Generator().manual_seed(0)
    offs = torch.tensor([100, 100, 517, 990], dtype=torch.int32)  # an empty group; 10 tokens in none
    g = torch.randn(1000, 48, generator=gen).bfloat16()
    x = torch.randn(1000, 32, generator=gen).bfloat16()
    emulated = fp8.grouped_mm(g.t(), x, offs)
    monkeypatch.setattr(fp8_gemm, "fast_path_reason", lambda *a, **k: None)
    monkeypatch.setattr(tg, "available", lambda x: None)
    monkeypatch.setattr(tg, "group_amax", lambda x, offs, plan: tg.group_amax_reference(x, offs))
    monkeypatch.setattr(tg, "cast_groups_transposed", lambda *args: tg.cast_groups_transposed_reference(*args[:-1]))
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _scaled_grouped_mm_emulated)
    fast = fp8.grouped_mm(g.t(), x, offs)
    assert fast.shape == (4, 48, 32) and fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), emulated.float(), rtol=1e-2, atol=1e-3)
    assert not fast[1].float().any()  # the empty expert's gradient is zero


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_dense_weight_gradient_through_the_token_major_cast_equals_the_emulated_one(recipe, monkeypatch):
    """The FP8 linear's weight gradient with both operands cast straight into the token-contiguous
    layout (``fp8_gemm.token_major``: the grouped kernels with one group; their references stand in
    here) against the emulated path: the same quantized operands, so the same weight gradient,
    also with GDN's high-precision tail rows and when it is added into main_grad. 1000 tokens: the
    contraction padded to 1008."""
    linear = linear_case(recipe)

    def run(hp_rows, main_grad):
        return linear(hp_rows, main_grad)[1:]  # the weight and input gradients

    cases = [(0, False), (16, False), (0, True)]
    emulated = [run(*c) for c in cases]
    monkeypatch.setattr(fp8_gemm, "fast_path_reason", lambda *a, **k: None)
    monkeypatch.setattr(tg, "available", lambda x: None)
    monkeypatch.setattr(tg, "group_amax", lambda x, offs, plan: tg.group_amax_reference(x, offs))
    monkeypatch.setattr(tg, "column_amax", tg.column_amax_reference)
    monkeypatch.setattr(tg, "cast_transposed", tg.cast_transposed_reference)
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_emulated)
    calls = []
    token_major = fp8_gemm.token_major
    monkeypatch.setattr(fp8_gemm, "token_major", lambda x, *a, **k: calls.append(x.shape) or token_major(x, *a, **k))
    for case, (dw_e, dx_e) in zip(cases, emulated):
        dw, dx = run(*case)
        torch.testing.assert_close(dw, dw_e, rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(dx, dx_e, rtol=0, atol=0)  # the input gradient's path is unchanged
    assert len(calls) == 2 * len(cases)  # g and x of every weight gradient went through it
    assert (calls[2], calls[3]) == ((1000, 80), (1000, 64))  # the 16 tail rows stay high precision


def test_unfused_path_is_taken_loudly_once(monkeypatch, caplog):
    """Where torch's grouped FP8 GEMM runs but the kernels cannot (here: meta tensors), the torch-op
    quantization runs, with one warning naming why."""
    monkeypatch.setattr(fp8_gemm, "fast_path_reason", lambda *a, **k: None)
    fp8_gemm._warn_unfused.cache_clear()
    offs = torch.tensor([10, 40], dtype=torch.int32, device="meta")
    a = torch.empty(48, 40, device="meta", dtype=torch.bfloat16)
    b = torch.empty(40, 32, device="meta", dtype=torch.bfloat16)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            assert fp8.grouped_mm(a, b, offs).shape == (2, 48, 32)
    warnings = [r.message for r in caplog.records if "fused quantization not used" in r.message]
    assert len(warnings) == 1 and "not on a CUDA device" in warnings[0]


@pytest.mark.gpu
def test_token_group_kernels_are_bit_exact_in_e4m3_on_the_gpu():
    gen = torch.Generator(device="cuda").manual_seed(0)
    offs = torch.tensor([1000, 1000, 5170, 9000], dtype=torch.int32, device="cuda")
    x = (torch.randn(9013, 2048, device="cuda", generator=gen) * 3).bfloat16()
    new_offs, width = tg.padded_offsets(offs, x.shape[0])
    for v in (x, x.t().contiguous().t()):
        amax = tg.group_amax(v, offs)
        assert torch.equal(amax, tg.group_amax_reference(v, offs))
        scale = fp8_gemm.scale_from_amax(amax, fp8_gemm.E4M3, True)
        got = tg.cast_groups_transposed(v, offs, new_offs, width, scale, fp8_gemm.E4M3)
        want = tg.cast_groups_transposed_reference(v, offs, new_offs, width, scale, fp8_gemm.E4M3)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        # one group, both scale forms
        amax = tg.column_amax(v)
        assert torch.equal(amax, tg.column_amax_reference(v))
        for scale in (fp8_gemm.scale_from_amax(amax, fp8_gemm.E4M3, True), torch.tensor(0.37, device="cuda")):
            got = tg.cast_transposed(v, scale, fp8_gemm.E4M3)
            want = tg.cast_transposed_reference(v, scale, fp8_gemm.E4M3)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
