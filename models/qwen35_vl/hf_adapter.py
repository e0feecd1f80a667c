"""Qwen3.5-VL's Hugging Face adapter (``ModelFamily.hf_adapter``, whose docstring lists the members):
the config and weight mapping of hf.py and the parity tools of parity.py, in one module that
scripts/convert_hf.py, hf_parity.py and bench_train.py reach through the family."""

from __future__ import annotations

from models.qwen35_vl.hf import (
    build_from_hf,
    fused_experts,
    hf_config_from_ours,
    hf_rows,
    hf_sources,
    hf_to_ours,
    load_hf_state_dict,
    lora_to_hf,
    model_config_from_hf,
    ours_to_hf,
    split_to_hf,
)
from models.qwen35_vl.parity import HF_MODELING_MODULES, load_full_state_dict, run_parity, use_hf_torch_kernels

__all__ = [
    "HF_MODELING_MODULES",
    "build_from_hf",
    "fused_experts",
    "hf_rows",
    "hf_sources",
    "split_to_hf",
    "hf_config_from_ours",
    "hf_to_ours",
    "load_full_state_dict",
    "load_hf_state_dict",
    "lora_to_hf",
    "model_config_from_hf",
    "ours_to_hf",
    "run_parity",
    "use_hf_torch_kernels",
]
