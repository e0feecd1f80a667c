"""Layer specs for the Qwen3.5 decoder, built from megatron-core modules without transformer-engine.

Layer i is Gated DeltaNet unless (i+1) is a multiple of ``full_attention_interval``, in
which case it is gated full attention (the released models: linear, linear, linear, full).
Every layer: zero-centred RMSNorm -> mixer -> residual -> RMSNorm -> MLP or MoE -> residual.
"""

from __future__ import annotations

import dataclasses
import functools

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from models.common.grouped_experts import GroupedExperts
from models.common.norms import GatedRMSNorm, RMSNorm
from models.qwen35_vl.attention import CoreAttention, MRopeSelfAttention
from models.qwen35_vl.gdn import Qwen35GatedDeltaNet


def _mixer_spec(kind: str) -> ModuleSpec:
    if kind == "gdn":
        return ModuleSpec(
            module=Qwen35GatedDeltaNet,
            submodules=GatedDeltaNetSubmodules(
                in_proj=ColumnParallelLinear, out_norm=GatedRMSNorm, out_proj=RowParallelLinear
            ),
        )
    return ModuleSpec(
        module=MRopeSelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=CoreAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=RMSNorm,
            k_layernorm=RMSNorm,
        ),
    )


def _mlp_spec(num_experts: int | None):
    """megatron's local MLP, or its MoELayer (router, shared expert) with our grouped experts."""
    mlp = get_mlp_module_spec_for_backend(LocalSpecProvider(), num_experts=num_experts, moe_grouped_gemm=False)
    if not num_experts:
        return mlp
    submodules = dataclasses.replace(mlp.keywords["submodules"], experts=GroupedExperts)
    return functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": submodules})


def layer_spec(kind: str, num_experts: int | None) -> ModuleSpec:
    mlp = _mlp_spec(num_experts)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=_mixer_spec(kind),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def stage_layers(config, pp_rank: int | None = None) -> range:
    """Global indices of the decoder layers this pipeline stage builds.

    megatron's TransformerBlock builds every spec it is handed when given a
    TransformerBlockSubmodules, so the per-stage slice is ours to take; we take it with
    megatron's own offset / count so our slice and its layer numbering (and therefore the
    sharded-checkpoint keys) agree on every stage.
    """
    if config.pipeline_model_parallel_size == 1:
        return range(config.num_layers)
    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    return range(offset, offset + get_num_layers_to_build(config, pp_rank=pp_rank))


def decoder_block_spec(m, config=None, pp_rank: int | None = None) -> TransformerBlockSubmodules:
    """Specs of the decoder layers of the model section ``m`` (its hybrid pattern, dense or MoE).

    Without ``config`` (or with one pipeline stage) every layer; with a TransformerConfig whose
    ``pipeline_model_parallel_size`` > 1, only this stage's layers. The layer kind is decided
    from the *global* layer index, so the GDN / attention pattern is the same whatever the split.
    """
    layers = range(m.num_layers) if config is None else stage_layers(config, pp_rank)
    kinds = ["attention" if m.is_full_attention(i) else "gdn" for i in layers]
    specs = [layer_spec(k, m.num_experts or None) for k in kinds]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=RMSNorm)


def mtp_layer_spec(m) -> ModuleSpec:
    """The MTP head's decoder layer: a gated full-attention layer with the decoder's MLP or MoE
    (HF ``mtp.layers.0``; vLLM builds it as Qwen3_5DecoderLayer(layer_type="full_attention"))."""
    return layer_spec("attention", m.num_experts or None)
