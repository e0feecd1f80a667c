"""Gated full attention with MRoPE on megatron-core's SelfAttention.

megatron-core supplies the projections (fused q|gate|k|v per query group, tensor
parallel), the zero-centred q/k norms (from our spec) and the sigmoid output gate
(``attention_output_gate``). Two things are ours:
- MRoPE is applied right after the q/k norms from per-token angles. megatron's own
  rotary path indexes frequencies by position within each packed sample (and syncs with
  the host per layer in THD); MRoPE needs the 3-D position of every token instead.
- ``CoreAttention`` (models/common/core_attention.py) routes to our backend (SDPA / varlen),
  replacing megatron's ``DotProductAttention``, which needs CUDA memory buffers and cannot do
  packed batches.
"""

from __future__ import annotations

from megatron.core.transformer.attention import SelfAttention

from kernels import fused_mrope
from kernels.rotary import apply_rotary, axis_of_frequency, mrope_angles
from models.common.core_attention import CoreAttention

__all__ = ["CoreAttention", "MRopeSelfAttention"]


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
