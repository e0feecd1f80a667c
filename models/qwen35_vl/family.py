"""Qwen3.5-VL as the trainer sees it: its ``models.family.ModelFamily`` (the registry entry).

Imports no torch: the pieces that need it are imported when called."""

from __future__ import annotations

from models.family import ModelFamily
from models.qwen35_vl import flops, param_counts
from models.qwen35_vl.config import ModelConfig
from models.qwen35_vl.processor_files import processor_settings
from models.qwen35_vl.validate import validate


def _build(*args, **kwargs):
    from models.qwen35_vl.model import build  # torch + megatron: imported when a model is built

    return build(*args, **kwargs)


def _video_position_grids(grid):
    from models.qwen35_vl.mrope import split_video_grids

    return split_video_grids(grid)


def _position_ids(*args):
    from models.qwen35_vl.mrope import mrope_position_ids

    return mrope_position_ids(*args)


def _hf_adapter():
    import models.qwen35_vl.hf_adapter as adapter  # torch + transformers' names: imported when asked for

    return adapter


def _packed_row_extras(cu_seqlens, device) -> dict:
    """The GDN layers' varlen chunk table, built once per packed micro-batch on the host."""
    from fused_kernels.gated_delta_rule import GDNVarlen

    return {"mixer_varlen": GDNVarlen.from_host(cu_seqlens, device)}


def _prepare_host_batch(batch: dict, m) -> None:
    """Fill the vision geometry cache with the batch's image sizes (prefetch thread)."""
    grid = batch.get("image_grid_thw")
    if grid is not None and grid.numel():
        from models.qwen35_vl.vision_geometry import warm_geometry

        warm_geometry(grid, m.vision.spatial_merge_size, m.vision.grid_side)


def _vision_graph_buckets(max_patches: int, unit: int) -> list[int]:
    from models.qwen35_vl.vision_graphs import bucket_sizes

    return bucket_sizes(max_patches, unit)


def _mixer_checkpoints(mixer, modules, blocks) -> int:
    from models.qwen35_vl.layer_hooks import mixer_checkpoints  # torch: imported when recompute is installed

    return mixer_checkpoints(mixer, modules, blocks)


def _graph_row_buffers(*args):
    from models.qwen35_vl.layer_hooks import graph_row_buffers  # torch: imported when graphs are installed

    return graph_row_buffers(*args)


FAMILY = ModelFamily(
    name="qwen35_vl",
    config_class=ModelConfig,
    build=_build,
    training_flops=flops.training_flops,
    stage_params=param_counts.stage_params,
    model_params=param_counts.model_params,
    activation_bytes_per_token=param_counts.activation_bytes_per_token,
    vision_bytes_per_patch=param_counts.vision_bytes_per_patch,
    position_ids=_position_ids,
    video_position_grids=_video_position_grids,
    validate=validate,
    vision_graph_buckets=_vision_graph_buckets,
    recompute_modules=("layernorm", "gdn_qkv", "gdn_norm_out", "core_attn", "moe_act", "shared_experts"),
    recompute_modules_no_cp=("gdn_qkv", "gdn_norm_out"),  # under CP the GDN layers take another path
    mixer_checkpoints=_mixer_checkpoints,
    graph_row_buffers=_graph_row_buffers,
    packed_row_extras=_packed_row_extras,
    prepare_host_batch=_prepare_host_batch,
    hf_adapter=_hf_adapter,
    processor_settings=processor_settings,
    # top level of a vision-language config.json; the _text types: a text-only config, which
    # model_config_from_hf reads as well
    hf_model_types=("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"),
)
