"""Qwen3.5-VL as the trainer sees it: its ``models.family.ModelFamily`` (the registry entry)."""

from __future__ import annotations

from models.family import ModelFamily
from models.qwen35_vl import flops, param_counts


def _build(*args, **kwargs):
    from models.qwen35_vl.model import build  # torch + megatron: imported when a model is built

    return build(*args, **kwargs)


def _recompute_mixers() -> tuple[type, ...]:
    from models.qwen35_vl.gdn import Qwen35GatedDeltaNet

    return (Qwen35GatedDeltaNet,)


FAMILY = ModelFamily(
    name="qwen35_vl",
    build=_build,
    training_flops=flops.training_flops,
    stage_params=param_counts.stage_params,
    model_params=param_counts.model_params,
    activation_bytes_per_token=param_counts.activation_bytes_per_token,
    vision_bytes_per_patch=param_counts.vision_bytes_per_patch,
    recompute_mixers=_recompute_mixers,
)
