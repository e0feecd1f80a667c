"""Model registry: a recipe's ``model.name`` -> its ``models.family.ModelFamily``.

An architecture is a folder ``models/<name>/`` plus one entry in ``MODEL_REGISTRY``. Its family
(``models/<name>/family.py``) provides everything the trainer needs of it:
- ``config_class`` / ``validate``: the dataclass the recipe's ``model`` section is read into and
  the family's rules for it (one-line ``ConfigError``s); ``hf_adapter``: its HF config and weights;
- ``build``: ``(model_cfg, parallel_cfg, params_dtype, pre_process, post_process, deterministic)``
  -> a ``models.base.MultimodalModel`` (this pipeline stage's part);
- ``position_ids``: one sample's position ids, made by the data pipeline;
- ``training_flops``: forward + backward FLOPs of a batch from its sample lengths, image grids and
  the tokens the LM head ran on (tflops_per_gpu, MFU);
- ``stage_params`` / ``model_params``: the exact parameter count per rank of a pipeline stage and
  of the whole model (total, active) for ``--dry-run``;
- ``activation_bytes_per_token`` / ``vision_bytes_per_patch``: the activation terms of the dry
  run's memory estimate, per decoder layer kind and per image patch;
- ``recompute_modules`` / ``mixer_checkpoints`` / ``graph_row_buffers`` / ``vision_graph_buckets``:
  what it has of the trainer's selective recompute and CUDA graphs, and what its mixers need of them;
- ``packed_row_extras``: what its layers need of a packed micro-batch, built once on the host;
- ``hf_adapter`` / ``hf_model_types``: its Hugging Face conversion and parity tools, and the
  config.json ``model_type`` values they read (``get_hf_adapter``, ``family_for_hf_config``).
The folder also holds the model's layer specs, modules and HF mapping. ``models/family.py``
documents each field's signature; docs/configuration.md ("Adding a model") lists the steps, and
``tiny_dense_vl/`` is the smallest complete family.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from core.errors import ConfigError
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


def family_for_hf_model_type(model_type: str) -> ModelFamily:
    """The family whose ``hf_model_types`` lists a Hugging Face config.json ``model_type``."""
    for family in MODEL_REGISTRY.values():
        if model_type in family.hf_model_types:
            return family
    known = sorted(t for family in MODEL_REGISTRY.values() for t in family.hf_model_types)
    raise ConfigError(f"Hugging Face model_type {model_type!r} is read by no registered model family; known: {known}")


def family_for_hf_config(path: str | Path) -> ModelFamily:
    """The family of a Hugging Face checkpoint directory (or its config.json), by its ``model_type``
    (a config without a top-level one: its ``text_config``'s)."""
    path = Path(path)
    config = path if path.is_file() else path / "config.json"
    raw = json.loads(config.read_text())
    model_type = raw.get("model_type") or (raw.get("text_config") or {}).get("model_type")
    if not model_type:
        raise ConfigError(f"{config} has no model_type; add the one of its architecture (e.g. qwen3_5)")
    return family_for_hf_model_type(model_type)


def get_hf_adapter(family: ModelFamily):
    """The family's Hugging Face adapter (``ModelFamily.hf_adapter``), loaded; refused in one line
    for a family without one."""
    if family.hf_adapter is None:
        having = sorted(name for name, f in MODEL_REGISTRY.items() if f.hf_adapter is not None)
        raise ConfigError(f"model {family.name} has no Hugging Face adapter (ModelFamily.hf_adapter); "
                          f"Hugging Face conversion and comparison work for {having}")
    return family.hf_adapter()
