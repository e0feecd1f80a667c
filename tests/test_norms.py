"""The RMS norms' compiled path (model.compile_norms, on by default on GPU) against their eager
PyTorch references: forward and every input/weight gradient, fp32 and bf16, two token counts
through one dynamic graph (the count changes every batch)."""

from __future__ import annotations

import pytest
import torch

from models.common import norms


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.setattr(norms, "COMPILE", True)
    monkeypatch.setattr(norms, "_compiled", {})
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _grads(fn, inputs):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    out.backward(g)
    return out.detach(), [t.grad for t in inputs]


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_compiled_norms_match_the_eager_reference(compiled, dtype, tol):
    gen = torch.Generator().manual_seed(0)
    for tokens in (37, 100):  # second count reuses the dynamic graph
        x = torch.randn(tokens, 2, 64, generator=gen).to(dtype)
        gate = torch.randn(tokens, 2, 64, generator=gen).to(dtype)
        w = (0.1 * torch.randn(64, generator=gen)).to(dtype)
        for zero_centered in (True, False):
            m = norms.RMSNorm(hidden_size=64, zero_centered=zero_centered).to(dtype)
            m.weight.data.copy_(w)
            ref_out, ref_g = _grads(lambda a, b: norms.rms_norm_ref(a, b, m.eps, zero_centered), [x, w])
            out, got = _grads(lambda a, b: norms._impl(norms.rms_norm_ref, a)(a, b, m.eps, zero_centered), [x, w])
            assert out.dtype == dtype
            torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
            for a, b in zip(got, ref_g):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, float(b.abs().max())))
        ref_out, ref_g = _grads(lambda a, b, c: norms.gated_rms_norm_ref(a, b, c, 1e-6), [x, gate, w])
        out, got = _grads(lambda a, b, c: norms._impl(norms.gated_rms_norm_ref, a)(a, b, c, 1e-6), [x, gate, w])
        torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
        for a, b in zip(got, ref_g):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, float(b.abs().max())))
    assert set(norms._compiled) == {norms.rms_norm_ref, norms.gated_rms_norm_ref}
    assert all(c.compiled is not c.fn for c in norms._compiled.values())  # compiled, no fallback


def test_cpu_default_is_eager():
    x = torch.randn(3, 8)
    assert norms.COMPILE is None and norms._impl(norms.rms_norm_ref, x) is norms.rms_norm_ref


def test_failed_compile_falls_back_to_eager_once_with_a_warning(monkeypatch, caplog):
    def broken_compile(fn, **kw):
        def run(*a):
            raise torch._dynamo.exc.BackendCompilerFailed(lambda *x: None, RuntimeError("no triton"), None)
        return run

    monkeypatch.setattr(norms, "COMPILE", True)
    monkeypatch.setattr(norms, "_compiled", {})
    monkeypatch.setattr(torch, "compile", broken_compile)
    x, w = torch.randn(5, 8), torch.zeros(8)
    with caplog.at_level("WARNING", logger="models.common.norms"):
        for _ in range(3):
            out = norms._impl(norms.rms_norm_ref, x)(x, w, 1e-6, True)
    assert torch.equal(out, norms.rms_norm_ref(x, w, 1e-6, True))
    assert sum("torch.compile of rms_norm_ref failed" in r.message for r in caplog.records) == 1


@pytest.mark.slow
def test_variants_past_the_recompile_limit_run_eagerly_with_one_warning(compiled, monkeypatch, caplog):
    """A validation pass adds no-grad variants beside the training ones; past dynamo's limit the
    compiled norm (fullgraph) would raise: those calls run the eager norm instead."""
    monkeypatch.setattr(norms, "RECOMPILE_LIMIT", 1)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 2, 16, generator=gen), 0.1 * torch.randn(16, generator=gen)
    # torch's own override (pytest's monkeypatch of the config module leaves it without the key)
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level("WARNING", logger="models.common.norms"):
        norm = norms._impl(norms.rms_norm_ref, x)
        first = norm(x, w, 1e-6, True)  # compiled: variant 1
        for _ in range(2):
            strided = x.transpose(0, 1).contiguous().transpose(0, 1)  # another layout: past the limit
            out = norm(strided, w, 1e-6, True)
    torch.testing.assert_close(first, norms.rms_norm_ref(x, w, 1e-6, True))
    assert torch.equal(out, norms.rms_norm_ref(strided, w, 1e-6, True))
    assert norm.compiled is not norm.fn and norm.eager_variants == 2
    assert sum(r.name == "models.common.norms" and "recompile_limit" in r.message for r in caplog.records) == 1
