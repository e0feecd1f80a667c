"""PyTorch reference ops: packed (THD) results equal per-sample results; attention backend."""

from __future__ import annotations

import pytest
import torch

from kernels.gated_delta_rule import (
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


def test_packed_delta_rule_restarts_state_per_sample():
    g = torch.Generator().manual_seed(1)
    T, H, K, V = sum(LENS), 2, 16, 8
    q = l2norm(torch.randn(1, T, H, K, generator=g))
    k = l2norm(torch.randn(1, T, H, K, generator=g))
    v = torch.randn(1, T, H, V, generator=g)
    gate = -torch.rand(1, T, H, generator=g)
    beta = torch.rand(1, T, H, generator=g)
    packed = chunk_gated_delta_rule_ref(q, k, v, gate, beta, CU)
    parts = zip(*(_split(t) for t in (q, k, v, gate, beta)))
    alone = torch.cat([chunk_gated_delta_rule_ref(*p, None) for p in parts], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_delta_rule_matches_token_by_token_recurrence():
    """The chunked form equals the defining recurrence S_t = a_t S_{t-1} + b_t k_t (v_t - a_t S_{t-1}^T k_t)."""
    g = torch.Generator().manual_seed(2)
    T, H, K, V = 70, 2, 8, 4
    q = l2norm(torch.randn(1, T, H, K, generator=g))
    k = l2norm(torch.randn(1, T, H, K, generator=g))
    v = torch.randn(1, T, H, V, generator=g)
    gate = -torch.rand(1, T, H, generator=g)
    beta = torch.rand(1, T, H, generator=g)
    out = chunk_gated_delta_rule_ref(q, k, v, gate, beta, None)
    S = torch.zeros(H, K, V)
    ref = torch.empty(T, H, V)
    for t in range(T):
        S = S * gate[0, t].exp()[:, None, None]
        kt, vt, bt = k[0, t], v[0, t], beta[0, t]
        delta = vt - torch.einsum("hk,hkv->hv", kt, S)
        S = S + bt[:, None, None] * kt[:, :, None] * delta[:, None, :]
        ref[t] = torch.einsum("hk,hkv->hv", q[0, t] * K**-0.5, S)
    torch.testing.assert_close(out[0], ref, rtol=1e-4, atol=1e-4)


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
        with pytest.raises(RuntimeError, match="gdn_backend=fla"):
            gdn_backend("fla")
    with pytest.raises(ValueError, match="attention backend"):
        attention(q, q, q, causal=True, backend="flash9")
