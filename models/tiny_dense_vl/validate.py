"""tiny_dense_vl's recipe rules (``ModelFamily.validate``): what it does not have is refused by name."""

from __future__ import annotations

from core.errors import require
from models.tiny_dense_vl.config import ModelConfig


def validate(m: ModelConfig, p) -> None:
    require(m.num_experts == 0, f"model.num_experts={m.num_experts}: tiny_dense_vl has a dense MLP only; set 0")
    require(m.lora.rank == 0, "model.lora: tiny_dense_vl has no LoRA adapters; set model.lora.rank=0")
    require(m.head_dim % 2 == 0, f"model.head_dim ({m.head_dim}) must be even (rotary pairs channels)")
    require(m.num_query_groups % p.tp == 0,
            f"model.num_query_groups ({m.num_query_groups}) must be divisible by parallel.tp ({p.tp})")
    require(m.ffn_hidden_size % p.tp == 0,
            f"model.ffn_hidden_size ({m.ffn_hidden_size}) must be divisible by parallel.tp ({p.tp})")
    v = m.vision
    for name in ("hidden_size", "in_channels", "patch_size", "temporal_patch_size", "spatial_merge_size"):
        require(getattr(v, name) >= 1, f"model.vision.{name} must be >= 1, got {getattr(v, name)}")
