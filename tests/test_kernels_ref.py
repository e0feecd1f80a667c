"""PyTorch reference ops: packed (THD) results equal per-sample results; attention backend."""

from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError
from fused_kernels.gated_delta_rule import (
    causal_conv1d_silu_ref,
    chunk_gated_delta_rule_ref,
    gdn_backend,
    l2norm,
)
from models.common.attention import attention, block_diagonal_mask, varlen_available

LENS = [5, 70, 1, 33]
CU = torch.tensor([0, 5, 75, 76, 109], dtype=torch.int32)


def _split(x, dim=1):
    return torch.split(x, LENS, dim=dim)


def test_packed_conv_resets_at_sample_starts():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, sum(LENS), 12, generator=g)
    w = torch.randn(12, 4, generator=g)
    packed = causal_conv1d_silu_ref(x, w, CU)
    alone = torch.cat([causal_conv1d_silu_ref(s, w, None) for s in _split(x)], dim=1)
    torch.testing.assert_close(packed, alone)


def _delta_inputs(seed, T, H, K, V):
    """Leaf tensors (q, k unnormalised) for the gated delta rule: q, k, v, log-decay g <= 0, beta."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, T, H, K), (1, T, H, K), (1, T, H, V)]
    q, k, v = (torch.randn(*s, generator=g) for s in shapes)
    gate, beta = -torch.rand(1, T, H, generator=g), torch.rand(1, T, H, generator=g)
    return [t.requires_grad_() for t in (q, k, v, gate, beta)]


def _recurrence(q, k, v, gate, beta):
    """The defining token-by-token form: S_t = a_t S + b_t k_t (v_t - k_t^T a_t S); o_t = q_t S_t / sqrt(K)."""
    _, T, H, K = q.shape
    S = torch.zeros(H, K, v.shape[-1])
    outs = []
    for t in range(T):
        S = S * gate[0, t].exp()[:, None, None]
        delta = v[0, t] - torch.einsum("hk,hkv->hv", k[0, t], S)
        S = S + beta[0, t][:, None, None] * k[0, t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[0, t] * K**-0.5, S))
    return torch.stack(outs)[None]


def test_packed_delta_rule_restarts_state_per_sample():
    q, k, v, gate, beta = _delta_inputs(1, sum(LENS), 2, 16, 8)
    q, k = l2norm(q), l2norm(k)
    packed = chunk_gated_delta_rule_ref(q, k, v, gate, beta, CU)
    parts = zip(*(_split(t) for t in (q, k, v, gate, beta)))
    alone = torch.cat([chunk_gated_delta_rule_ref(*p, None) for p in parts], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_delta_rule_matches_token_by_token_recurrence_forward_and_backward():
    leaves = _delta_inputs(2, 70, 2, 8, 4)
    weight = torch.randn(1, 70, 2, 4, generator=torch.Generator().manual_seed(3))
    results = []
    for fn in (lambda *a: chunk_gated_delta_rule_ref(*a, None), _recurrence):
        q, k, v, gate, beta = leaves
        out = fn(l2norm(q), l2norm(k), v, gate, beta)
        grads = torch.autograd.grad((out * weight).sum(), leaves)
        results.append((out, grads))
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for name, a, b in zip("qkvgb", grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"grad of {name}")


@pytest.mark.parametrize("causal", [True, False])
def test_packed_sdpa_equals_per_sample_attention(causal):
    g = torch.Generator().manual_seed(3)
    T = sum(LENS)
    q = torch.randn(T, 4, 16, generator=g)
    k = torch.randn(T, 2, 16, generator=g)
    v = torch.randn(T, 2, 16, generator=g)
    packed = attention(q, k, v, causal=causal, cu_seqlens=CU, max_seqlen=max(LENS), backend="sdpa")
    alone = torch.cat([
        attention(qs[None], ks[None], vs[None], causal=causal, backend="sdpa")[0]
        for qs, ks, vs in zip(*(torch.split(t, LENS) for t in (q, k, v)))
    ])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_block_mask_never_crosses_samples():
    mask = block_diagonal_mask(CU, sum(LENS), causal=True)
    assert not mask[5:75, :5].any() and not mask[:5, 5:].any()
    assert mask[74, 5] and not mask[5, 6]


def test_cpu_backends_are_chosen_and_explicit_requests_fail_loudly():
    q = torch.randn(4, 2, 8)
    if not torch.cuda.is_available():
        assert varlen_available(q) is not None
        assert gdn_backend("auto") == "torch"
        with pytest.raises(RuntimeError, match="varlen"):
            attention(q, q, q, causal=True, cu_seqlens=torch.tensor([0, 4], dtype=torch.int32),
                      max_seqlen=4, backend="varlen")
        with pytest.raises(ConfigError, match="gdn_backend=fla cannot run: .*; set model.gdn_backend=auto"):
            gdn_backend("fla")
    with pytest.raises(ValueError, match="attention backend"):
        attention(q, q, q, causal=True, backend="flash9")
