"""Gated full attention with MRoPE on megatron-core's SelfAttention.

megatron-core supplies the projections (fused q|gate|k|v per query group, tensor
parallel), the zero-centred q/k norms (from our spec) and the sigmoid output gate
(``attention_output_gate``). Two things are ours:
- MRoPE is applied right after the q/k norms from per-token angles
  (models/common/rotary_attention.py): megatron's own rotary path indexes frequencies by
  position within each packed sample; MRoPE needs the 3-D position of every token instead.
- ``CoreAttention`` (models/common/core_attention.py) routes to our backend (SDPA / varlen),
  replacing megatron's ``DotProductAttention``, which needs CUDA memory buffers and cannot do
  packed batches.
"""

from __future__ import annotations

from fused_kernels import fused_mrope
from fused_kernels.rotary import apply_rotary, axis_of_frequency, mrope_angles
from models.common.core_attention import CoreAttention
from models.common.rotary_attention import RotarySelfAttention

__all__ = ["CoreAttention", "MRopeSelfAttention"]


class MRopeSelfAttention(RotarySelfAttention):
    # set by Qwen35LanguageModel (with a buffer mrope_inv_freq) for the fused path
    mrope_section: tuple = ()
    mrope_interleaved: bool = True

    def rotate(self, query, key, rotary):
        # rotary: MRoPE angles [S, B, 1, rot_dim], or with model.fused_mrope the position ids
        # [3, B, S] (int): one fused kernel per tensor
        if not rotary.is_floating_point():
            return self._rotate_from_positions(query, key, rotary)
        return super().rotate(query, key, rotary)

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
