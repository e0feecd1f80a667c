"""How many forward-sized passes training spends on each part of a vision-language model, given
``model.freeze`` and ``model.lora``: the multipliers of the families' training FLOPs.

A matmul's training cost is its forward, plus one forward-sized product for the gradient of its
input when the backward has to pass through it, plus one for the gradient of its weight when that
weight trains. Weight-free products (attention scores, the delta rule) cost two forward-sized
products in a backward that passes them. With nothing frozen every part is 3 x forward, the usual
count; a frozen part is counted as the work the GPU does for it, not as if it trained (a LoRA
step of the 2B recipe ran its base weights' backward for the input gradients only). LoRA's own
adapter products (2 x rank x (in + out) per token and adapted layer, about 1-2% of a layer at
rank 16) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUPS = ("vision", "merger", "language", "embedding", "lm_head")  # model.freeze's names


@dataclass(frozen=True)
class TrainingPasses:
    """Forward-sized passes per part (1 = forward only, 3 = a weight that trains)."""

    decoder_weights: int
    decoder_core: int  # the decoder's weight-free products
    lm_head: int
    vision: int  # the encoder blocks and patch embedding (weights and attention alike)
    merger: int

    @classmethod
    def of(cls, m) -> "TrainingPasses":
        frozen = set(GROUPS) if m.lora.rank else set(m.freeze)  # LoRA: every base weight is frozen
        trains = {g: g not in frozen for g in GROUPS}
        # the backward passes through the decoder when something at or below it trains (LoRA: the
        # adapters in every layer, which need the input gradients)
        through_decoder = bool(m.lora.rank) or any(trains[g] for g in ("language", "embedding", "vision", "merger"))
        through_vision = trains["vision"]  # nothing below the encoder trains but itself
        return cls(
            decoder_weights=1 + through_decoder + trains["language"],
            decoder_core=1 + 2 * through_decoder,
            lm_head=1 + through_decoder + trains["lm_head"],
            vision=3 if through_vision else 1,
            merger=1 + through_vision + trains["merger"],
        )
