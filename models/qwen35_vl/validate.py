"""Qwen3.5-VL's recipe rules (``ModelFamily.validate``): its shapes against the parallel layout,
its layer pattern, MRoPE sections, MoE and kernel choices. Each rule is one ``ConfigError`` line
naming the field and the fix; the trainer's own rules (heads against tp/cp, batch arithmetic)
are multimodal/config.py's."""

from __future__ import annotations

from core.errors import require
from models.qwen35_vl.config import ModelConfig


def validate(m: ModelConfig, p) -> None:
    """``p``: the recipe's parallel section (models/common/parallel_config.py)."""
    # torch and megatron come with these: imported when the rules run, so that registering the
    # family (models/family.py) stays torch-free
    from fused_kernels.gated_delta_rule import GDN_BACKENDS
    from models.base import PARAMETER_GROUPS

    require(m.full_attention_interval >= 1,
            f"model.full_attention_interval must be >= 1, got {m.full_attention_interval}")
    require(m.gdn_backend in GDN_BACKENDS,
            f"model.gdn_backend must be one of {'|'.join(GDN_BACKENDS)}, got {m.gdn_backend!r}")
    require(m.gdn_pre_impl in ("auto", "fused", "unfused"),
            f"model.gdn_pre_impl must be auto|fused|unfused, got {m.gdn_pre_impl!r}")
    for name in ("linear_num_key_heads", "linear_num_value_heads"):
        require(getattr(m, name) % (p.tp * p.cp) == 0,
                f"model.{name} ({getattr(m, name)}) must be divisible by parallel.tp*cp ({p.tp * p.cp})")
    require(m.linear_num_value_heads % m.linear_num_key_heads == 0,
            "model.linear_num_value_heads must be a multiple of model.linear_num_key_heads")
    rot = int(m.head_dim * m.partial_rotary_factor)
    require(rot % 2 == 0 and sum(m.mrope_section) == rot // 2,
            f"model.mrope_section {m.mrope_section} must sum to head_dim*partial_rotary_factor/2 = {rot // 2}")
    # the fused projection of gated attention: q and its output gate, k, v
    qkv_out = 2 * m.num_attention_heads * m.head_dim + 2 * m.num_query_groups * m.head_dim
    require(qkv_out % p.tp == 0, f"the fused q|gate|k|v projection ({qkv_out}) must be divisible by parallel.tp")
    if m.num_experts:
        require(m.num_experts % p.ep == 0,
                f"model.num_experts ({m.num_experts}) must be divisible by parallel.ep ({p.ep})")
        require(1 <= m.moe_router_topk <= m.num_experts, "model.moe_router_topk must be in [1, num_experts]")
        require(m.moe_token_dispatcher in ("alltoall", "allgather"),
                "model.moe_token_dispatcher must be alltoall|allgather")
        # experts are sharded over expert-TP = tp (megatron's default)
        require(m.moe_ffn_hidden_size % p.tp == 0,
                f"model.moe_ffn_hidden_size ({m.moe_ffn_hidden_size}) must be divisible by the expert "
                f"tensor-parallel size (= parallel.tp = {p.tp})")
        require(m.moe_shared_expert_intermediate_size % p.tp == 0,
                f"model.moe_shared_expert_intermediate_size ({m.moe_shared_expert_intermediate_size}) "
                f"must be divisible by parallel.tp ({p.tp})")
    require(m.mtp_num_layers >= 0, f"model.mtp_num_layers must be >= 0, got {m.mtp_num_layers}")
    require(m.mtp_loss_scale >= 0, f"model.mtp_loss_scale must be >= 0, got {m.mtp_loss_scale}")
    require(m.mtp_num_layers or "mtp" not in m.freeze,
            "model.freeze names mtp but model.mtp_num_layers=0 (no MTP head): drop mtp from model.freeze")
    require(m.mtp_num_layers or not set(PARAMETER_GROUPS) - {"mtp"} <= set(m.freeze),
            "model.freeze: every group is frozen (there is no MTP head, model.mtp_num_layers=0), nothing "
            "would train; leave at least one out")
    v = m.vision
    require(v.hidden_size % v.num_heads == 0, "model.vision.hidden_size must be divisible by model.vision.num_heads")
