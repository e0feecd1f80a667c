"""Which tokens are vision placeholders: the positions whose embeddings the vision encoder's
features replace. Images and videos have their own placeholder ids (``<|image_pad|>``,
``<|video_pad|>``); the encoder's features follow the order of all of them together."""

from __future__ import annotations

import torch


def vision_token_mask(tokens: torch.Tensor, ids: int | tuple[int, ...]) -> torch.Tensor:
    """True where ``tokens`` holds one of ``ids`` (one id, or the image and video ids)."""
    if isinstance(ids, int):
        return tokens == ids
    mask = tokens == ids[0]
    for i in ids[1:]:
        mask = mask | (tokens == i)
    return mask
