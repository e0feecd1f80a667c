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

from models.common.attention import attention
from models.qwen35_vl.mrope import apply_rotary


class MRopeSelfAttention(SelfAttention):
    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        # rotary_pos_emb carries MRoPE angles [S, B, 1, rot_dim]; we apply them ourselves.
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
        return (apply_rotary(query, angles), apply_rotary(key, angles), *rest)


class CoreAttention(MegatronModule):
    """Causal softmax attention through models.common.attention (megatron's core_attention slot)."""

    backend: str = "auto"

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **_):
        super().__init__(config=config)
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_):
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            q, k, v = (t.reshape(t.shape[0], t.shape[-2], t.shape[-1]) for t in (query, key, value))
            out = attention(
                q, k, v, causal=True, scale=self.scale, cu_seqlens=cu,
                max_seqlen=packed_seq_params.max_seqlen_q, backend=self.backend,
            )
            return out.reshape(out.shape[0], -1)
        # megatron layout [S, B, H, D] -> ours [B, S, H, D]
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        out = attention(q, k, v, causal=True, scale=self.scale, backend=self.backend)
        return out.transpose(0, 1).reshape(out.shape[1], out.shape[0], -1)

