"""FP8's tensorwise casts in Triton (fused_kernels/fp8_tensorwise.py): the two kernels against their
PyTorch references under Triton's CPU interpreter, the FP8 linear wired through them (the references
standing in for the kernels, torch's FP8 GEMM written out) against the emulated path, and, on a GPU,
the kernels bit-exact in e4m3 and e5m2 against the references and the compiled casts."""

from __future__ import annotations

import pytest
import torch

from fused_kernels import fp8_tensorwise as tw
from fused_kernels import fp8_token_groups as tg
from models.common import fp8_gemm
from tests.helpers.fp8_cases import linear_case, run_interpreted, scaled_mm_emulated

# Shapes: several amax chunks (CHUNK_ROWS = 512) and column blocks, a ragged edge, a tall narrow
# tensor, empty ones; each row-major, column-major and as a column slice of a wider tensor (GDN's
# in_proj gradient without its high-precision tail). The interpreter's fp32 -> fp8 conversion does
# not round to nearest even as the GPU's does, so on the CPU the cast writes fp16 (its largest
# finite value then sets the scale): the reduction, the scale's arithmetic, the strides and the
# layout are checked bit for bit; the fp8 store is checked on the GPU.
_INTERP_CHECK = """
import json, torch
from fused_kernels import fp8_tensorwise as tw
out = []
for n, cols in [(1000, 96), (1300, 40), (32, 256), (0, 16), (7, 0)]:
    torch.manual_seed(n + cols)
    x = (torch.randn(n, cols) * torch.logspace(-3, 2, cols)).to(torch.bfloat16)
    for v in (x, x.t().contiguous().t(), torch.cat([x, x], 1)[:, :cols]):
        assert tw.available(v) is None, tw.available(v)
        want_amax = tw.tensor_amax_reference(v)
        got = tw.cast(v, want_amax, torch.float16)
        want = tw.cast_reference(v, want_amax, torch.float16)
        # the scales are tensors of their own (the GEMM's scale pointers must be aligned)
        own = got[1].storage_offset() == got[2].storage_offset() == 0 and got[1].untyped_storage().nbytes() == 4
        out.append([n, cols, bool(torch.equal(tw.tensor_amax(v), want_amax)),
                    [bool(torch.equal(a, b)) for a, b in zip(got, want)], list(got[0].shape),
                    got[0].is_contiguous() and own])
# the largest |x| alone at a chunk's last row, or negative in the last element: no row or column skipped
for row, col, value in [(511, 3, 1024.0), (1299, 39, -2048.0), (512, 0, 4096.0)]:  # exact in bf16
    x = torch.randn(1300, 40).to(torch.bfloat16)
    x[row, col] = value
    out.append([bool(torch.equal(tw.tensor_amax(x), torch.tensor(abs(value))))])
# the scale from an amax whose reciprocal rounds: torch's `max / amax` is a reciprocal, then a product
amaxes = torch.tensor([3.0, 7.0, 0.1, 1e-20, 0.0, 12345.678])
scales = [tw.cast(torch.ones(1, 1), a, torch.float16)[1] for a in amaxes]
out.append([bool(torch.equal(s, tw.scales_reference(a, torch.float16)[0])) for s, a in zip(scales, amaxes)])
print(json.dumps(out))
"""


def test_tensorwise_kernels_equal_their_references_under_the_interpreter():
    *rows, edges, edges2, edges3, scales = run_interpreted(_INTERP_CHECK)
    assert len(rows) == 15 and edges + edges2 + edges3 == [True] * 3
    for n, cols, amax_equal, cast_equal, shape, laid_out in rows:
        assert amax_equal and cast_equal == [True, True, True] and shape == [n, cols] and laid_out, (n, cols)
    assert scales == [True] * 6


def test_linear_through_the_tensorwise_kernels_equals_the_emulated_one(monkeypatch):
    """``_Fp8Linear`` under ``tensorwise`` with its casts through the tensorwise kernels (the references
    stand in for them) against the emulated path: the same scales and fp8 values, so the same
    output and input gradient, and a weight gradient equal up to the padded contraction's summation
    order; also with GDN's high-precision tail rows (the gradient cast as a column slice) and when
    the weight gradient is added into main_grad. Every cast went through the kernels."""
    run = linear_case("tensorwise")
    cases = [(0, False), (16, False), (0, True)]
    emulated = [run(*c) for c in cases]
    monkeypatch.setattr(fp8_gemm, "fast_path_reason", lambda *a, **k: None)
    calls = {"amax": [], "cast": [], "transposed": []}

    def spy(name, fn):
        return lambda x, *a: calls[name].append((tuple(x.shape), x.is_contiguous())) or fn(x, *a)

    monkeypatch.setattr(tw, "available", lambda x: None)
    monkeypatch.setattr(tw, "tensor_amax", spy("amax", tw.tensor_amax_reference))
    monkeypatch.setattr(tw, "cast", spy("cast", tw.cast_reference))
    monkeypatch.setattr(tg, "available", lambda x: None)
    monkeypatch.setattr(tg, "cast_transposed", spy("transposed", tg.cast_transposed_reference))
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_emulated)
    for case, (out_e, dw_e, dx_e) in zip(cases, emulated):
        out, dw, dx = run(*case)
        torch.testing.assert_close(out, out_e, rtol=0, atol=0)
        torch.testing.assert_close(dx, dx_e, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dw, dw_e, rtol=1e-2, atol=1e-3)
    # per linear: amax and cast of x, the weight and the gradient; the weight transposed for the input
    # gradient, then the gradient and x token-major for the weight gradient
    assert len(calls["amax"]) == len(calls["cast"]) == 3 * len(cases)
    assert len(calls["transposed"]) == 3 * len(cases)
    assert calls["cast"][3:6] == [((1000, 64), True), ((80, 64), True), ((1000, 80), False)]  # the tail's rows kept
    assert calls["transposed"][3:6] == [((80, 64), True), ((1000, 80), False), ((1000, 64), True)]


@pytest.mark.gpu
def test_tensorwise_kernels_are_bit_exact_on_the_gpu():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(9013, 2100, device="cuda", generator=gen) * 3).bfloat16()
    for v in (x, x.t().contiguous().t(), x[:, :2048]):
        amax = tw.tensor_amax(v)
        assert torch.equal(amax, tw.tensor_amax_reference(v))
        for dtype in (fp8_gemm.E4M3, fp8_gemm.E5M2):
            got, want = tw.cast(v, amax, dtype), tw.cast_reference(v, amax, dtype)
            assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
            assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
            # the same bits as the compiled cast the kernels replace, and its scale
            compiled, inv = fp8_gemm._kernel(fp8_gemm._quantize, v)(v, None, dtype, False, False)
            assert torch.equal(got[0].view(torch.uint8), compiled.view(torch.uint8)) and torch.equal(got[2], inv)
