"""Build Qwen3.5-VL (dense or MoE) from a recipe's ``model`` section on megatron-core."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

from core.errors import ConfigError
from fused_kernels.rotary import axis_of_frequency, inverse_frequencies, mrope_angles
from models.base import MultimodalModel
from models.common import norms, swiglu
from models.common.language_model import FusedLossGPTModel
from models.common.moe_aux_loss import use_group_mean_token_count
from models.common.mtp import MTPBlock
from models.common.virtual_pipeline import chunk_layers, megatron_pipeline
from models.common.moe_dispatch import GroupedDispatcher
from models.common.moe_nvtx import add_moe_nvtx_ranges
from models.qwen35_vl import attention as attn_mod
from models.qwen35_vl import gdn as gdn_mod
from models.qwen35_vl.specs import decoder_block_spec, mtp_layer_spec
from models.qwen35_vl.vision import VisionEncoder


FUSED_KERNELS_BY_DEFAULT = True  # what model.fused_mrope=null / gdn_pre_impl=auto pick on GPU


class Qwen35LanguageModel(FusedLossGPTModel):
    """GPTModel whose rotary embedding is Qwen3.5's interleaved MRoPE from 3-D position ids."""

    # set by build() from model.fused_mrope: attention then gets the position ids, not angles
    fused_mrope: bool = False

    def __init__(self, *args, rot_dim: int, rope_theta: float, mrope_section: list[int], interleaved: bool,
                 mtp_num_layers: int = 0, mtp_layer_spec=None, **kw):
        super().__init__(*args, position_embedding_type="none", **kw)
        # every pipeline stage knows the depth: the first computes the MTP input embeddings, the
        # middle ones pass them on (models/base.py)
        self.mtp_num_layers = mtp_num_layers
        if mtp_num_layers and self.post_process:  # with the LM head, whose weight it shares
            self.mtp = MTPBlock(self.config, mtp_layer_spec, mtp_num_layers, vp_stage=self.vp_stage)
        self.register_buffer("mrope_inv_freq", inverse_frequencies(rot_dim, rope_theta), persistent=False)
        self.register_buffer(
            "mrope_axis", axis_of_frequency(rot_dim // 2, mrope_section, interleaved), persistent=False
        )
        for mod in self.modules():  # what the fused path needs to rotate q/k from position ids
            if isinstance(mod, attn_mod.MRopeSelfAttention):
                mod.mrope_section, mod.mrope_interleaved = tuple(mrope_section), interleaved
                mod.register_buffer("mrope_inv_freq", self.mrope_inv_freq.clone(), persistent=False)

    def _preprocess(self, input_ids, position_ids, *args, **kwargs):
        out = list(super()._preprocess(input_ids, position_ids, *args, **kwargs))
        if self.fused_mrope:  # MRopeSelfAttention rotates q/k from them in one kernel per tensor
            out[1] = position_ids
            return tuple(out)
        # position_ids [3, B, S] -> angles [S, B, 1, rot_dim], consumed by MRopeSelfAttention
        angles = mrope_angles(position_ids, self.mrope_inv_freq, self.mrope_axis)  # [B, S, rot]
        out[1] = angles.transpose(0, 1).unsqueeze(2)
        return tuple(out)


def _on_cuda_by_default(choice: bool | None) -> bool:
    return torch.cuda.is_available() if choice is None else bool(choice)


def transformer_config(cfg, parallel, params_dtype: torch.dtype, deterministic: bool = False) -> TransformerConfig:
    m = cfg
    overlap = getattr(parallel, "moe_a2a_overlap", False)
    if overlap and params_dtype != torch.bfloat16:
        # validate() lets train.precision=auto through; here it has resolved to fp32 (no GPU)
        raise ConfigError(f"parallel.moe_a2a_overlap=true needs bf16 weights, got {params_dtype} "
                          "(train.precision=auto is fp32 without a GPU); set train.precision=bf16")
    moe = {}
    if m.num_experts:
        moe = dict(
            num_moe_experts=m.num_experts,
            moe_router_topk=m.moe_router_topk,
            moe_ffn_hidden_size=m.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size or None,
            moe_shared_expert_gate=bool(m.moe_shared_expert_intermediate_size),
            moe_router_score_function="softmax",
            moe_router_pre_softmax=False,  # softmax over the top-k logits == renormalised top-k
            moe_aux_loss_coeff=m.moe_aux_loss_coeff,
            moe_router_load_balancing_type="aux_loss",
            moe_token_dispatcher_type=m.moe_token_dispatcher,
            moe_grouped_gemm=False,  # megatron's flag means Transformer Engine; ours: specs.GroupedExperts
            moe_router_dtype="fp32",
            # combined 1F1B: the model then needs build_schedule_plan (MultimodalModel has it)
            overlap_moe_expert_parallel_comm=overlap,
        )
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.head_dim,
        ffn_hidden_size=m.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=m.rms_norm_eps,
        layernorm_zero_centered_gamma=True,
        qk_layernorm=True,
        attention_output_gate=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        # SwiGLU through megatron's fused function (fused_bias_swiglu); no bias here
        bias_activation_fusion=_on_cuda_by_default(getattr(m, "fused_swiglu", None)),
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        init_method_std=m.init_method_std,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=m.full_attention_interval,
        linear_conv_kernel_dim=m.linear_conv_kernel_dim,
        linear_key_head_dim=m.linear_key_head_dim,
        linear_value_head_dim=m.linear_value_head_dim,
        linear_num_key_heads=m.linear_num_key_heads,
        linear_num_value_heads=m.linear_num_value_heads,
        tensor_model_parallel_size=parallel.tp,
        **megatron_pipeline(parallel),
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        sequence_parallel=parallel.sequence_parallel and parallel.tp > 1,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        calculate_per_token_loss=True,
        deterministic_mode=deterministic,
        **moe,
    )


def _enter_through_one_node(module: torch.nn.Module) -> None:
    """The shared expert reads its input twice (fc1 and the sigmoid gate) beside the router and
    the routed experts. Passing the input through one view node sums the shared expert's two
    input gradients before they meet the others, in every run; then its selective recompute
    (``train.recompute_modules: [shared_experts]``), which returns them already summed, gives
    the same bits as the run without it. A view costs nothing."""
    forward = module.forward
    module.forward = lambda hidden_states, *a, **k: forward(hidden_states.view(hidden_states.shape), *a, **k)


def build(cfg, parallel, params_dtype: torch.dtype, pre_process: bool = True, post_process: bool = True,
          deterministic: bool = False, vp_stage: int | None = None) -> MultimodalModel:
    """``vp_stage``: this pipeline rank's virtual stage (models/common/virtual_pipeline.py)."""
    m = cfg
    tcfg = transformer_config(m, parallel, params_dtype, deterministic)
    if tcfg.bias_activation_fusion:
        swiglu.route_swiglu_to_triton()  # megatron's fused SwiGLU through our Triton kernels where they apply
    if m.num_experts:
        use_group_mean_token_count()  # aux-loss scaling that does not depend on the CP/SP split
    attn_mod.CoreAttention.backend = m.attention_backend
    norms.COMPILE = m.compile_norms
    gdn_mod.Qwen35GatedDeltaNet.gdn_backend_request = m.gdn_backend
    gdn_mod.Qwen35GatedDeltaNet.save_states = m.gdn_save_states
    # auto: the fused Triton kernels on GPU, the PyTorch path on CPU. (They are marked
    # do_not_specialize on the shape arguments, so new batch shapes do not recompile them,
    # docs/kernels.md.)
    gpu = torch.cuda.is_available() and FUSED_KERNELS_BY_DEFAULT
    gdn_mod.Qwen35GatedDeltaNet.gdn_pre_impl = ("fused" if gpu else "unfused") if m.gdn_pre_impl == "auto" \
        else m.gdn_pre_impl
    rot_dim = int(m.head_dim * m.partial_rotary_factor)
    # this chunk's layers of the whole decoder's hybrid pattern (kinds follow the global index)
    every_layer, layers = decoder_block_spec(m), chunk_layers(tcfg, vp_stage)
    block = TransformerBlockSubmodules(layer_specs=every_layer.layer_specs[layers.start:layers.stop],
                                       layer_norm=every_layer.layer_norm)
    language = Qwen35LanguageModel(
        config=tcfg,
        transformer_layer_spec=block,
        vocab_size=m.vocab_size,
        max_sequence_length=m.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=m.tie_word_embeddings,
        scatter_embedding_sequence_parallel=False,
        rot_dim=rot_dim,
        rope_theta=m.rope_theta,
        mrope_section=list(m.mrope_section),
        interleaved=m.mrope_interleaved,
        mtp_num_layers=m.mtp_num_layers,
        mtp_layer_spec=mtp_layer_spec(m),
        vp_stage=vp_stage,
    )
    language.mtp_loss_scale = m.mtp_loss_scale
    language.fused_mrope = gpu if m.fused_mrope is None else m.fused_mrope
    language.fused_linear_ce = m.fused_linear_ce
    vision = None
    if pre_process:
        vision = VisionEncoder(m.vision, out_hidden=m.hidden_size, attn_backend=m.attention_backend)
        vision.fused_rotary = language.fused_mrope
        # a model built on the meta device (streaming HF conversion) stays there: shapes only
        device = "meta" if next(vision.parameters()).is_meta else (
            torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
        vision.to(device=device, dtype=params_dtype)
    add_moe_nvtx_ranges(language)  # GPU only: shared experts / dispatch / experts / combine in a profile
    for module in language.modules():
        if isinstance(module, SharedExpertMLP):
            _enter_through_one_node(module)
        if isinstance(module, MoELayer):
            GroupedDispatcher.adopt(module)  # token counts stay on the device for the grouped experts
    if parallel.tp > 1:
        # The GDN output norm's weight (one per value-head channel, shared by all heads) is
        # replicated over TP but each rank only sees its own heads, so its gradient is a partial
        # sum; megatron reduces such grads over TP only for q/k norms and sequence-parallel
        # norms. The training loop sums grads of params marked this way over TP once per step.
        for module in language.modules():
            if isinstance(module, gdn_mod.Qwen35GatedDeltaNet):
                module.out_norm.weight.tp_partial_grad = True
    return MultimodalModel(tcfg, language, vision, m.vision_token_ids, pre_process, post_process)
