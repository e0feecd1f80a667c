"""Gated full attention with MRoPE on megatron-core's SelfAttention.

megatron-core supplies the projections (fused q|gate|k|v per query group, tensor
parallel), the zero-centred q/k norms (from our spec) and the sigmoid output gate
(``attention_output_gate``). Two things are ours:
- MRoPE is applied right after the q/k norms from per-token angles. megatron's own
  rotary path indexes frequencies by position within each packed sample (and syncs with
  the host per layer in THD); MRoPE needs the 3-D position of every token instead.
- ``CoreAttention`` routes to our backend (SDPA / varlen), replacing megatron's
  ``DotProductAttention``, which needs CUDA memory buffers and cannot do packed batches.
"""

from __future__ import annotations

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import MegatronModule

from kernels import fused_mrope
from models.common.attention import attention
from models.common.packed_seq import PackedRowParams, cp_info, segment_boundaries
from models.common.cp_collectives import heads_to_tokens, split_heads, tokens_to_heads
from kernels.rotary import apply_rotary, axis_of_frequency, mrope_angles


class MRopeSelfAttention(SelfAttention):
    # set by Qwen35LanguageModel (with a buffer mrope_inv_freq) for the fused path
    mrope_section: tuple = ()
    mrope_interleaved: bool = True

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        # rotary_pos_emb carries MRoPE angles [S, B, 1, rot_dim], or with model.fused_mrope the
        # position ids [3, B, S] (int); we apply them ourselves.
        self._mrope_angles = rotary_pos_emb
        try:
            return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs)
        finally:
            self._mrope_angles = None

    def get_query_key_value_tensors(self, *args, **kwargs):
        out = super().get_query_key_value_tensors(*args, **kwargs)
        angles = getattr(self, "_mrope_angles", None)
        if angles is None:
            return out
        query, key, *rest = out
        if not angles.is_floating_point():  # position ids: one fused kernel per tensor
            return (*self._rotate_from_positions(query, key, angles), *rest)
        return (apply_rotary(query, angles), apply_rotary(key, angles), *rest)

    def _rotate_from_positions(self, query, key, pos):
        if self.mrope_inv_freq.device != query.device:
            self.mrope_inv_freq = self.mrope_inv_freq.to(query.device)
        inv = self.mrope_inv_freq
        layout = "sbhd" if query.dim() == 4 else "thd"
        reason = fused_mrope.available(query, layout)
        if reason is None:
            # one autograd node, a launch per tensor each way: no cat of q and k to rotate them in
            # one launch, whose backward zero-fills and sums q|k-sized gradients
            return fused_mrope.fused_mrope_pair(query, key, pos, inv, self.mrope_section, self.mrope_interleaved,
                                                layout)
        fused_mrope.warn_fallback(reason)
        axis = axis_of_frequency(inv.numel(), list(self.mrope_section), self.mrope_interleaved)
        angles = mrope_angles(pos, inv, axis).transpose(0, 1).unsqueeze(2)  # [S, B, 1, rot]
        return apply_rotary(query, angles), apply_rotary(key, angles)


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
