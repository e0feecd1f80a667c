"""``model.freeze``: parts of the model that do not train.

A frozen parameter has ``requires_grad=False`` before megatron's DDP and optimizer are built, so
it gets no fp32 gradient buffer, no fp32 main copy and no Adam moments: the memory goes away,
not just the update, and the weight stays bit-identical. Autograd skips the backward of a part
nothing trainable depends on (a frozen vision tower costs its forward only).

The groups are the model's own (``MultimodalModel.parameter_group``): vision, merger, language,
embedding, lm_head.
"""

from __future__ import annotations

import logging

import torch

from models.common.frozen_linear import fold_frozen_linear_inputs

log = logging.getLogger(__name__)


def check_freeze(groups: list[str], tied_embeddings: bool) -> str | None:
    """Why this ``model.freeze`` cannot run (None when it can)."""
    from models.base import PARAMETER_GROUPS

    unknown = sorted(set(groups) - set(PARAMETER_GROUPS))
    if unknown:
        return f"unknown group(s) {unknown}; choose from {list(PARAMETER_GROUPS)}"
    if set(groups) == set(PARAMETER_GROUPS):
        return "every group is frozen, nothing would train; leave at least one out"
    if tied_embeddings and ("embedding" in groups) != ("lm_head" in groups):
        return ("embedding and lm_head are one weight (model.tie_word_embeddings=true): "
                "freeze both or neither")
    return None


def freeze(model: torch.nn.Module, groups: list[str]) -> dict[str, tuple[int, int]]:
    """Freeze ``groups`` of ``model`` (before DDP and the optimizer); returns, per group,
    (trainable, total) parameters on this rank."""
    counts = {}
    for name, param in model.named_parameters():
        group = model.parameter_group(name)
        if group in groups:
            param.requires_grad_(False)
        trainable, total = counts.get(group, (0, 0))
        counts[group] = (trainable + (param.numel() if param.requires_grad else 0), total + param.numel())
    if groups:
        fold_frozen_linear_inputs()  # frozen linears take megatron's frozen-weight path
    return counts


def describe(counts: dict[str, tuple[int, int]]) -> str:
    trainable = sum(c[0] for c in counts.values())
    total = sum(c[1] for c in counts.values())
    parts = ", ".join(f"{g} {a:,} of {b:,}" for g, (a, b) in counts.items())
    return f"trainable parameters on this rank: {trainable:,} of {total:,} ({parts})"
