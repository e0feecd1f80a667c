"""Model registry: a recipe's ``model.name`` -> its ``models.family.ModelFamily``.

An architecture is a folder ``models/<name>/`` plus one entry in ``MODEL_REGISTRY``. Its family
(``models/<name>/family.py``) provides everything the trainer needs of it:
- ``config_class`` / ``validate``: the dataclass the recipe's ``model`` section is read into and
  the family's rules for it (one-line ``ConfigError``s); ``config_from_hf``: its HF config reader;
- ``build``: ``(model_cfg, parallel_cfg, params_dtype, pre_process, post_process, deterministic)``
  -> a ``models.base.MultimodalModel`` (this pipeline stage's part);
- ``position_ids``: one sample's position ids, made by the data pipeline;
- ``training_flops``: forward + backward FLOPs of a batch from its sample lengths, image grids and
  the tokens the LM head ran on (tflops_per_gpu, MFU);
- ``stage_params`` / ``model_params``: the exact parameter count per rank of a pipeline stage and
  of the whole model (total, active) for ``--dry-run``;
- ``activation_bytes_per_token`` / ``vision_bytes_per_patch``: the activation terms of the dry
  run's memory estimate, per decoder layer kind and per image patch;
- ``recompute_modules`` / ``recompute_mixers`` / ``vision_graph_buckets``: what it has of the
  trainer's selective recompute and vision CUDA graphs.
The folder also holds the model's layer specs, modules and HF mapping. ``models/family.py``
documents each field's signature; docs/configuration.md ("Adding a model") lists the steps, and
``tiny_dense_vl/`` is the smallest complete family.
"""

from __future__ import annotations

from collections.abc import Callable

from models.family import ModelFamily
from models.qwen35_vl.family import FAMILY as QWEN35_VL
from models.tiny_dense_vl.family import FAMILY as TINY_DENSE_VL

MODEL_REGISTRY: dict[str, ModelFamily] = {
    "qwen35_vl": QWEN35_VL,
    "tiny_dense_vl": TINY_DENSE_VL,
}
DEFAULT_MODEL = "qwen35_vl"  # what a recipe without model.name builds


def get_model_family(name: str) -> ModelFamily:
    try:
        return MODEL_REGISTRY[name]
    except KeyError:
        raise KeyError(f"model.name {name!r} is not registered; known: {sorted(MODEL_REGISTRY)}") from None


def get_model_builder(name: str) -> Callable:
    return get_model_family(name).build
