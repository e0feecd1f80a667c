"""The recipe's ``model`` section for Qwen3.5-VL (``model.name: qwen35_vl``): the fields every
architecture has (``models/common/model_config.py``) plus the hybrid Gated DeltaNet / gated
attention layout, MRoPE, MoE, the GDN kernels and the ViT. Typed dataclasses with defaults only;
loading is the trainer's (multimodal/config.py), the rules are ``models/qwen35_vl/validate.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from models.common.model_config import LoRAConfig
from models.common.model_config import ModelConfig as CommonModelConfig

__all__ = ["LoRAConfig", "ModelConfig", "VisionConfig"]


@dataclass
class VisionConfig:
    depth: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0

    @property
    def grid_side(self) -> int:
        """The side of the square learned position table (``num_position_embeddings`` entries)."""
        return int(self.num_position_embeddings**0.5)


@dataclass
class ModelConfig(CommonModelConfig):
    name: str = "qwen35_vl"
    full_attention_interval: int = 4  # layer i is full attention when (i+1) % interval == 0
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    mrope_section: list[int] = field(default_factory=lambda: [2, 1, 1])
    mrope_interleaved: bool = True
    # MoE (num_experts, in the common fields: 0 means a dense MLP in every layer)
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 64
    moe_shared_expert_intermediate_size: int = 0
    moe_aux_loss_coeff: float = 1e-3
    moe_token_dispatcher: str = "alltoall"  # alltoall | allgather
    # auto = flash_qla where `flash_qla` imports (SM90/SM100), else fla, else torch
    gdn_backend: str = "auto"  # auto | flash_qla (fused_kernels/flash_qla_gdr.py) | fla | torch
    # fla backend: keep the delta rule's per-chunk states (w, h, v_new; ~134 MB per GDN layer at 8K
    # tokens and 16 heads of 128, bf16) from the forward for the backward instead of fla's
    # recomputing them there (fused_kernels/fla_saved_states.py). false = fla's own autograd function.
    gdn_save_states: bool = True
    # Fused Triton kernels beside PyTorch references (fused_kernels/fused_mrope.py, fused_pre_gdr.py).
    # null / auto: the kernels on GPU, the PyTorch path on CPU (model.py FUSED_KERNELS_BY_DEFAULT).
    # Asked for but unable to run (CPU without TRITON_INTERPRET, unsupported dtype): one warning,
    # then the PyTorch path.
    fused_mrope: bool | None = None
    gdn_pre_impl: str = "auto"  # auto | fused | unfused
    # Multi-token prediction depths trained beside the LM loss (models/common/mtp.py; 0 = none); left
    # unset with a Hugging Face config: the checkpoint's mtp_num_hidden_layers (the released ones have 1)
    mtp_num_layers: int = 0
    mtp_loss_scale: float = 0.1  # the weight of the mean MTP loss added to the LM loss
    # initial weights: layout_independent = a function of train.seed alone, the same model under any
    # TP/PP/EP/CP/DP layout (models/common/layout_init.py); megatron = megatron-core's per-rank draw
    init: str = "layout_independent"
    vision: VisionConfig = field(default_factory=VisionConfig)

    def is_full_attention(self, layer: int) -> bool:
        """The hybrid pattern: layer i is gated full attention when (i+1) % interval == 0, else GDN."""
        return (layer + 1) % self.full_attention_interval == 0
