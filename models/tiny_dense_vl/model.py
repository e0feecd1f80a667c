"""Build tiny_dense_vl on megatron-core: GPTModel layers (RMSNorm, causal attention with 1-D
rotary, SwiGLU MLP) and a vision path of two linear maps."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from torch import nn

from fused_kernels.rotary import inverse_frequencies
from models.base import MultimodalModel
from models.common.core_attention import CoreAttention
from models.common.language_model import FusedLossGPTModel
from models.common import norms
from models.common.norms import RMSNorm
from models.common.rotary_attention import RotarySelfAttention
from models.common.virtual_pipeline import chunk_layers, megatron_pipeline


class TinyLanguageModel(FusedLossGPTModel):
    """Rotary angles from the first row of the position ids [3, B, S] (the data pipeline fills the
    three rows with the same 1-D positions for this family: ``family.position_ids``)."""

    def __init__(self, *args, head_dim: int, rope_theta: float, **kw):
        super().__init__(*args, position_embedding_type="none", **kw)
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, rope_theta), persistent=False)

    def _preprocess(self, input_ids, position_ids, *args, **kwargs):
        out = list(super()._preprocess(input_ids, position_ids, *args, **kwargs))
        freqs = position_ids[0].float()[..., None] * self.inv_freq.to(position_ids.device)  # [B, S, D/2]
        out[1] = torch.cat([freqs, freqs], -1).transpose(0, 1).unsqueeze(2)  # [S, B, 1, D]
        return tuple(out)


class PatchMerger(nn.Module):
    """Patches [N, C*t*p*p] (window-contiguous, models/common/vision_patches.py) -> a linear
    embedding each -> every merge x merge window concatenated -> one image token [N / merge^2, out]."""

    def __init__(self, v, out_hidden: int):
        super().__init__()
        self.patch_embed = nn.Linear(v.in_channels * v.temporal_patch_size * v.patch_size**2, v.hidden_size)
        self.norm = nn.LayerNorm(v.hidden_size, eps=1e-6)
        self.merger = nn.Linear(v.hidden_size * v.spatial_merge_size**2, out_hidden)

    @staticmethod
    def parameter_group(name: str) -> str:
        """The model.freeze groups: ``merger`` for the merger, ``vision`` for the patch embedding."""
        return "merger" if name.startswith("merger") else "vision"

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        x = self.norm(F.gelu(self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))))
        return self.merger(x.view(-1, self.merger.in_features))


def transformer_config(m, parallel, params_dtype: torch.dtype, deterministic: bool = False) -> TransformerConfig:
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups, kv_channels=m.head_dim, ffn_hidden_size=m.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=m.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, bias_activation_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=parallel.tp, **megatron_pipeline(parallel),
        context_parallel_size=parallel.cp, sequence_parallel=parallel.sequence_parallel and parallel.tp > 1,
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16, pipeline_dtype=params_dtype,
        use_cpu_initialization=not torch.cuda.is_available(), calculate_per_token_loss=True,
        deterministic_mode=deterministic,
    )


def layer_spec() -> ModuleSpec:
    attention = ModuleSpec(
        module=RotarySelfAttention, params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=CoreAttention,
                                           linear_proj=RowParallelLinear),
    )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm, self_attention=attention, self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm, mlp=get_mlp_module_spec_for_backend(LocalSpecProvider()),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def build(cfg, parallel, params_dtype: torch.dtype, pre_process: bool = True, post_process: bool = True,
          deterministic: bool = False, vp_stage: int | None = None) -> MultimodalModel:
    """``vp_stage``: this pipeline rank's virtual stage (models/common/virtual_pipeline.py)."""
    m = cfg
    tcfg = transformer_config(m, parallel, params_dtype, deterministic)
    CoreAttention.backend = m.attention_backend
    norms.COMPILE = m.compile_norms
    layers = len(chunk_layers(tcfg, vp_stage))  # this chunk's
    language = TinyLanguageModel(
        config=tcfg,
        transformer_layer_spec=TransformerBlockSubmodules(layer_specs=[layer_spec()] * layers, layer_norm=RMSNorm),
        vocab_size=m.vocab_size, max_sequence_length=m.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, share_embeddings_and_output_weights=m.tie_word_embeddings,
        scatter_embedding_sequence_parallel=False, head_dim=m.head_dim, rope_theta=m.rope_theta, vp_stage=vp_stage,
    )
    language.fused_linear_ce = m.fused_linear_ce
    vision = None
    if pre_process:
        vision = PatchMerger(m.vision, m.hidden_size)
        vision.to(device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu", dtype=params_dtype)
    return MultimodalModel(tcfg, language, vision, m.image_token_id, pre_process, post_process)
