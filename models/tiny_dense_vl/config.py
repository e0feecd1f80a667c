"""The recipe's ``model`` section for ``model.name: tiny_dense_vl``: the common fields
(models/common/model_config.py) plus rotary and the vision path's sizes."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.common.model_config import ModelConfig as CommonModelConfig


@dataclass
class VisionConfig:
    hidden_size: int = 64  # width of a patch's embedding before the merger
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2  # merge x merge neighbouring patches -> one image token


@dataclass
class ModelConfig(CommonModelConfig):
    name: str = "tiny_dense_vl"
    rope_theta: float = 10_000.0  # 1-D rotary over the whole head, from the sequence position
    vision: VisionConfig = field(default_factory=VisionConfig)
