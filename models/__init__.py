"""Model registry: a recipe's ``model.name`` -> a builder.

A builder takes ``(model_cfg, parallel_cfg, params_dtype, pre_process, post_process,
deterministic)`` and returns a ``models.base.MultimodalModel``. Adding an architecture
is one entry here plus its folder (config/specs/model/hf files, as in ``qwen35_vl/``).
"""

from __future__ import annotations

from collections.abc import Callable


def _qwen35_vl(*args, **kwargs):
    from models.qwen35_vl.model import build

    return build(*args, **kwargs)


MODEL_REGISTRY: dict[str, Callable] = {
    "qwen35_vl": _qwen35_vl,
}


def get_model_builder(name: str) -> Callable:
    try:
        return MODEL_REGISTRY[name]
    except KeyError:
        raise KeyError(f"model.name {name!r} is not registered; known: {sorted(MODEL_REGISTRY)}") from None
