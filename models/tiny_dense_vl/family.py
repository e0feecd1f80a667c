"""tiny_dense_vl as the trainer sees it: its ``models.family.ModelFamily`` (the registry entry).

Imports no torch: the builder and the position ids import it when called."""

from __future__ import annotations

from models.family import ModelFamily
from models.tiny_dense_vl import counts
from models.tiny_dense_vl.config import ModelConfig
from models.tiny_dense_vl.validate import validate


def _build(*args, **kwargs):
    from models.tiny_dense_vl.model import build

    return build(*args, **kwargs)


def position_ids(input_ids, image_grid_thw, image_token_id: int, spatial_merge_size: int):
    """1-D positions 0..L-1, image tokens included, on all three rows of the batch's [3, L]."""
    import torch

    return torch.arange(len(input_ids), dtype=torch.long).expand(3, -1).contiguous()


FAMILY = ModelFamily(
    name="tiny_dense_vl",
    config_class=ModelConfig,
    build=_build,
    training_flops=counts.training_flops,
    stage_params=counts.stage_params,
    model_params=counts.model_params,
    activation_bytes_per_token=counts.activation_bytes_per_token,
    vision_bytes_per_patch=counts.vision_bytes_per_patch,
    position_ids=position_ids,
    validate=validate,
)
