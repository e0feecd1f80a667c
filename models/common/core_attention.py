"""Causal attention in megatron-core's ``core_attention`` slot, through models/common/attention.py.

Replaces megatron's ``DotProductAttention``, which needs CUDA memory buffers and cannot do packed
batches: packed (THD) rows with their sample boundaries, batched rows, and head-parallel context
parallelism (models/common/cp_collectives.py).
"""

from __future__ import annotations

from megatron.core.transformer.module import MegatronModule

from models.common.attention import attention
from models.common.cp_collectives import heads_to_tokens, split_heads, tokens_to_heads
from models.common.packed_seq import PackedRowParams, cp_info, segment_boundaries


class CoreAttention(MegatronModule):
    """Causal softmax attention through models.common.attention (megatron's core_attention slot)."""

    backend: str = "auto"

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **_):
        super().__init__(config=config)
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_):
        cp = cp_info(packed_seq_params)
        if cp is not None:
            return self._context_parallel(query, key, value, cp)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = segment_boundaries(packed_seq_params)
            q, k, v = (t.reshape(t.shape[0], t.shape[-2], t.shape[-1]) for t in (query, key, value))
            one = isinstance(packed_seq_params, PackedRowParams) and packed_seq_params.one_segment(q.shape[0])
            out = attention(
                q, k, v, causal=True, scale=self.scale, cu_seqlens=cu,
                max_seqlen=packed_seq_params.max_seqlen_q, backend=self.backend, one_segment=one,
            )
            return out.reshape(out.shape[0], -1)
        # megatron layout [S, B, H, D] -> ours [B, S, H, D]
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        out = attention(q, k, v, causal=True, scale=self.scale, backend=self.backend)
        return out.transpose(0, 1).reshape(out.shape[1], out.shape[0], -1)

    def _context_parallel(self, query, key, value, cp):
        """Head-parallel attention over the whole sequence (see models/common/cp_collectives.py).

        q/k/v arrive as this rank's tokens [S_local, B, H, D] (THD: B = 1). KV heads that do not
        split over cp (e.g. 2 KV heads, cp = 4) are repeated up to the query heads first."""
        seq_local, batch = query.shape[0], query.shape[1] if query.dim() == 4 else 1
        q, k, v = (t.reshape(seq_local, batch, t.shape[-2], t.shape[-1]) for t in (query, key, value))
        if k.shape[2] % cp.cp_size:
            rep = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        q, k, v = (tokens_to_heads(split_heads(t, cp.cp_size), cp) for t in (q, k, v))  # [S, B, H/cp, D]
        if cp.qkv_format == "thd":
            out = attention(
                q[:, 0], k[:, 0], v[:, 0], causal=True, scale=self.scale, cu_seqlens=cp.cu_seqlens_q_padded,
                max_seqlen=cp.max_seqlen_q, backend=self.backend,
            )[:, None]
        else:
            out = attention(*(t.transpose(0, 1) for t in (q, k, v)), causal=True, scale=self.scale,
                            backend=self.backend).transpose(0, 1)
        out = heads_to_tokens(out, cp)  # [S_local, B, cp, H/cp, D]
        if cp.qkv_format == "thd":
            return out.reshape(seq_local, -1)
        return out.reshape(seq_local, batch, -1)
