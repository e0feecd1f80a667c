"""The recipe's ``model`` section for Qwen3.5-VL: architecture, token ids, kernel choices, freezing
and LoRA. Typed dataclasses with defaults only; loading and validation are the trainer's
(multimodal/config.py), which composes this section into the whole recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class LoRAConfig:
    """LoRA adapters on the language model's linear layers (multimodal/lora.py): y = W x +
    (alpha / rank) * B A dropout(x); the base weights are frozen, only A and B train."""

    rank: int = 0  # 0 = off
    alpha: float = 16.0
    dropout: float = 0.0
    # Layers that get an adapter: linear_qkv, linear_proj (full attention), in_proj, out_proj
    # (GDN), linear_fc1, linear_fc2 (dense MLP), shared_experts (the shared expert's fc1 and fc2).
    targets: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "in_proj", "out_proj",
                                                         "linear_fc1", "linear_fc2", "shared_experts"])


@dataclass
class ModelConfig:
    name: str = "qwen35_vl"  # key of models.MODEL_REGISTRY
    # A Hugging Face checkpoint dir (or its config.json): the architecture fields below are then
    # read from it at start-up (start from converted weights with checkpoint.load).
    hf_config: str | None = None
    hidden_size: int = 128
    num_layers: int = 4
    num_attention_heads: int = 4
    num_query_groups: int = 2
    head_dim: int = 32
    ffn_hidden_size: int = 256
    vocab_size: int = 1024
    max_position_embeddings: int = 262144
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
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    init_method_std: float = 0.02
    # MoE (num_experts == 0 means a dense MLP in every layer)
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 64
    moe_shared_expert_intermediate_size: int = 0
    moe_aux_loss_coeff: float = 1e-3
    moe_token_dispatcher: str = "alltoall"  # alltoall | allgather
    # token ids (from the tokenizer / HF config; the proxy uses a small synthetic vocab)
    image_token_id: int = 1000
    vision_start_token_id: int = 1001
    vision_end_token_id: int = 1002
    im_start_token_id: int = 1003
    im_end_token_id: int = 1004
    eos_token_id: int = 1005
    pad_token_id: int = 1006
    video_token_id: int = 1007  # <|video_pad|>: a video's frames, as image_token_id an image's
    # kernels
    attention_backend: str = "auto"  # auto | sdpa | varlen (models/common/attention.py)
    # auto = flash_qla where `flash_qla` imports (SM90/SM100), else fla, else torch
    gdn_backend: str = "auto"  # auto | flash_qla (kernels/flash_qla_gdr.py) | fla | torch
    # fla backend: keep the delta rule's per-chunk states (w, h, v_new; ~134 MB per GDN layer at 8K
    # tokens and 16 heads of 128, bf16) from the forward for the backward instead of fla's
    # recomputing them there (kernels/fla_saved_states.py). false = fla's own autograd function.
    gdn_save_states: bool = True
    # Fused Triton kernels beside PyTorch references (kernels/fused_mrope.py, fused_pre_gdr.py).
    # null / auto: the kernels on GPU, the PyTorch path on CPU (model.py FUSED_KERNELS_BY_DEFAULT).
    # Asked for but unable to run (CPU without TRITON_INTERPRET, unsupported dtype): one warning,
    # then the PyTorch path.
    fused_mrope: bool | None = None
    gdn_pre_impl: str = "auto"  # auto | fused | unfused
    # RMS norms through torch.compile (fused fwd/bwd kernels, same fp32 math); null = on CUDA only
    compile_norms: bool | None = None
    # SwiGLU (silu(a) * b of the MLP's fc1 output) fused: one kernel per direction instead of
    # silu, multiply, chunk and cat kernels, and only fc1's output kept for backward. Runs
    # kernels/fused_swiglu.py (Triton) where it applies, else megatron-core's compiled function
    # with a warning. null = on CUDA only (both need Triton there).
    fused_swiglu: bool | None = None
    # LM loss through kernels/fused_linear_ce.py: chunked logits, never [tokens, vocab] at once
    # (saves ~12 bytes x tokens x vocab/TP; costs one extra LM-head GEMM in backward). On by
    # default on CPU and GPU alike so CPU tests exercise the path the GPU runs; false restores
    # megatron's output layer + vocab_parallel_cross_entropy (same losses and grads).
    fused_linear_ce: bool = True
    # With fused_linear_ce on packed (THD) batches: the LM head and the loss run only at tokens
    # whose loss mask is nonzero (their indices are built on the host per micro-batch, no sync).
    # Exact: every other token has no loss and no gradient. In SFT, where prompts and images are
    # most of the tokens, this removes most of the LM head's work (tokens x hidden x vocab x 6);
    # the reported FLOPs then count the LM head at those tokens only. false: every token.
    sparse_lm_head: bool = True
    # Add each weight gradient into the fp32 main_grad inside its backward GEMM (linear layers,
    # the fused LM head) or lookup (word embedding, index_add_), models/performance/wgrad_fusion.py,
    # instead of a bf16 gradient plus a separate add per weight (dense [vocab, hidden] for the
    # embedding). null = on where it measured faster: with train.cuda_graphs and
    # cuda_graph_grads_to_main_grad on a GPU (H200, 2B, issue batch: 0.214-0.215 vs 0.217-0.222
    # s/step); off otherwise (eager it measured slower, 0.377 vs 0.342). true = on (exact fp32
    # accumulation of every weight gradient), or an error where it cannot run.
    grad_accum_fusion: bool | None = None
    # Parts of the model that do not train (multimodal/freeze.py), any of: vision (the ViT: patch
    # and position embeddings, blocks), merger (the patch merger into the LM), language (decoder
    # layers and final norm), embedding (token embedding), lm_head (output layer). Frozen weights
    # get no gradient buffer and no optimizer state, and stay bit-identical.
    freeze: list[str] = field(default_factory=list)
    # LoRA adapters (rank 0 = off); with them every base weight is frozen.
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)

    @property
    def vision_token_ids(self) -> tuple[int, int]:
        """The placeholder ids whose embeddings the vision encoder's features replace (image, video)."""
        return self.image_token_id, self.video_token_id

    def is_full_attention(self, layer: int) -> bool:
        """The hybrid pattern: layer i is gated full attention when (i+1) % interval == 0, else GDN."""
        return (layer + 1) % self.full_attention_interval == 0
