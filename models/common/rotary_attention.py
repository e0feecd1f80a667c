"""megatron-core's SelfAttention with q/k rotated by the model's own rotary input.

megatron's rotary path indexes frequencies by position within each packed sample (and syncs with
the host per layer in THD); our models compute per-token angles (or position ids) in their
language model's ``_preprocess`` instead and hand them over as ``rotary_pos_emb``. This class
keeps them from megatron's path and rotates q/k right after the projections (and q/k norms):
a subclass says how in ``rotate``.
"""

from __future__ import annotations

from megatron.core.transformer.attention import SelfAttention

from fused_kernels.rotary import apply_rotary


class RotarySelfAttention(SelfAttention):
    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        self._rotary = rotary_pos_emb
        try:
            return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs)
        finally:
            self._rotary = None

    def get_query_key_value_tensors(self, *args, **kwargs):
        query, key, *rest = super().get_query_key_value_tensors(*args, **kwargs)  # [S, B, H, D]
        rotary = getattr(self, "_rotary", None)
        if rotary is None:
            return (query, key, *rest)
        return (*self.rotate(query, key, rotary), *rest)

    def rotate(self, query, key, angles):
        """Angles [S, B, 1, rot_dim] (the first rot_dim channels of each head rotate)."""
        return apply_rotary(query, angles), apply_rotary(key, angles)
