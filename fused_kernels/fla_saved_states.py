"""fla's chunked gated delta rule, with the chunk states kept from the forward for the backward.

Why: fla 0.6.0's ``chunk_gated_delta_rule`` saves only its inputs and ``A``; its backward first
runs ``recompute_w_u_fwd`` and ``chunk_gated_delta_rule_fwd_h`` again to rebuild ``w`` and the
per-chunk states ``h`` the forward already had, work the backward can skip (docs/kernels.md,
Gated DeltaNet). Here the forward keeps ``w``, ``h``
and ``v_new`` (bf16; at 8K tokens and 16 heads of 128: h 67 MB, w and v_new 34 MB each per
layer) and the backward starts at fla's first backward kernel.

The calls are fla's own (``fla/ops/gated_delta_rule/chunk.py``), in its order and with its
arguments, only without the recomputation, so the results are fla's: ``tests/gpu/test_gdn_kernels_gpu.py``
compares them against fla's autograd function and an fp32 PyTorch reference on the GPU.
Supports what the model uses: no initial or final state, q and k already l2-normalised, beta
already through its sigmoid, g in log space (fp32), varlen via ``cu_seqlens``/``chunk_indices``.
"""

from __future__ import annotations

import torch

CHUNK = 64  # fla's default chunk size; fused_kernels.gated_delta_rule.FLA_CHUNK_SIZE


class GatedDeltaRuleSavedStates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens, chunk_indices, scale: float):
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2

        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        varlen = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        g_cum = chunk_local_cumsum(g, chunk_size=CHUNK, scale=RCP_LN2, **varlen)
        w, u, A = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_cum, beta=beta, chunk_size=CHUNK, **varlen)
        h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g_cum, initial_state=None,
                                                   output_final_state=False, chunk_size=CHUNK, **varlen)
        del u  # the backward needs v_new (u after the state corrections), not u
        o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g_cum, scale=scale, chunk_size=CHUNK, **varlen)
        ctx.save_for_backward(q, k, v, g_cum, beta, A, w, h, v_new, cu_seqlens, chunk_indices)
        ctx.scale = scale
        ctx.g_dtype = g.dtype
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
        from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv_local
        from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd
        from fla.ops.utils import chunk_local_cumsum

        q, k, v, g_cum, beta, A, w, h, v_new, cu_seqlens, chunk_indices = ctx.saved_tensors
        do = do.contiguous()
        scale = ctx.scale
        varlen = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        dv = chunk_bwd_dv_local(q=q, k=k, g=g_cum, do=do, scale=scale, chunk_size=CHUNK, **varlen)
        dh, _, dv = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, g=g_cum, h0=None, dht=None, do=do, dv=dv,
                                                   scale=scale, chunk_size=CHUNK, **varlen)
        dq, dk, dw, dg = chunk_bwd_dqkwg(q=q, k=k, v=v_new, w=w, g=g_cum, h=h, dv=dv, do=do, dh=dh, scale=scale,
                                         chunk_size=CHUNK, **varlen)
        dk2, dv, db, dg2 = prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=g_cum, A=A, dw=dw, du=dv, **varlen)
        dk.add_(dk2)
        dg.add_(dg2)
        dg = chunk_local_cumsum(dg, chunk_size=CHUNK, reverse=True, **varlen)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(ctx.g_dtype), db.to(beta.dtype), None, None, None


def chunk_gated_delta_rule_saved_states(q, k, v, g, beta, cu_seqlens=None, chunk_indices=None):
    """Same contract as fla's ``chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=False)[0]``
    with scale 1/sqrt(K); ``cu_seqlens`` int64 for packed rows (batch 1)."""
    if cu_seqlens is not None and chunk_indices is None:
        from fla.ops.utils.index import prepare_chunk_indices

        chunk_indices = prepare_chunk_indices(cu_seqlens, CHUNK)
    return GatedDeltaRuleSavedStates.apply(q, k, v, g, beta, cu_seqlens, chunk_indices, k.shape[-1] ** -0.5)
