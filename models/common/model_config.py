"""The part of a recipe's ``model`` section that every architecture has and the trainer reads.

Each family's config dataclass (``ModelFamily.config_class``, e.g. ``models/qwen35_vl/config.py``)
extends ``ModelConfig`` with its own fields and a ``vision`` section that has at least
``patch_size``, ``temporal_patch_size``, ``spatial_merge_size`` and ``in_channels`` (the data
pipeline cuts images into patches with them). Typed dataclasses with defaults only; loading and
validation are the trainer's (multimodal/config.py) and the family's (``ModelFamily.validate``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    name: str = ""  # key of models.MODEL_REGISTRY; picks the dataclass this section is read into
    # A Hugging Face checkpoint dir (or its config.json): the architecture fields are then read
    # from it at start-up (the family's HF adapter, model_config_from_hf; start from converted weights with checkpoint.load).
    hf_config: str | None = None
    hidden_size: int = 128
    num_layers: int = 4
    num_attention_heads: int = 4
    num_query_groups: int = 2
    head_dim: int = 32
    ffn_hidden_size: int = 256
    vocab_size: int = 1024
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    init_method_std: float = 0.02
    # routed experts per MoE layer; 0 = a dense MLP in every layer (a family without MoE refuses
    # anything else). Expert parallelism, the all-to-all overlap and MoE recompute read it.
    num_experts: int = 0
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
    attention_backend: str = "auto"  # auto | sdpa | varlen | cudnn (models/common/attention.py)
    # RMS norms through torch.compile (fused fwd/bwd kernels, same fp32 math); null = on CUDA only
    compile_norms: bool | None = None
    # SwiGLU (silu(a) * b of the MLP's fc1 output) fused: one kernel per direction instead of
    # silu, multiply, chunk and cat kernels, and only fc1's output kept for backward. Runs
    # fused_kernels/fused_swiglu.py (Triton) where it applies, else megatron-core's compiled function
    # with a warning. null = on CUDA only (both need Triton there).
    fused_swiglu: bool | None = None
    # LM loss through fused_kernels/fused_linear_ce.py: chunked logits, never [tokens, vocab] at once
    # (saves ~12 bytes x tokens x vocab/TP; costs one extra LM-head GEMM in backward). On by
    # default on CPU and GPU alike so CPU tests exercise the path the GPU runs; false restores
    # megatron's output layer + vocab_parallel_cross_entropy (same losses and grads).
    fused_linear_ce: bool = True
    # With fused_linear_ce on packed (THD) batches: the LM head and the loss run only at tokens
    # whose loss mask is nonzero (their indices are built on the host per micro-batch, no sync);
    # the MTP depths' passes through the head likewise, each at its own shifted loss tokens.
    # Exact: every other token has no loss and no gradient. In SFT, where prompts and images are
    # most of the tokens, this removes most of the LM head's work (tokens x hidden x vocab x 6);
    # the reported FLOPs then count the LM head at those tokens only. false: every token.
    sparse_lm_head: bool = True
    # Add each weight gradient into the fp32 main_grad inside its backward GEMM (linear layers,
    # the fused LM head) or lookup (word embedding, index_add_), models/performance/wgrad_fusion.py,
    # instead of a bf16 gradient plus a separate add per weight (dense [vocab, hidden] for the
    # embedding). null = on where it measured faster: with train.cuda_graphs and
    # train.cuda_graphs.grads_to_main_grad on a GPU; off otherwise (eager it measured slower; step
    # times in docs/kernels.md). true = on (exact fp32
    # accumulation of every weight gradient), or an error where it cannot run.
    grad_accum_fusion: bool | None = None
    # Parts of the model that do not train (multimodal/freeze.py), any of: vision (the vision
    # encoder), merger (the patch merger into the LM), language (decoder layers and final norm),
    # embedding (token embedding), lm_head (output layer). Frozen weights get no gradient buffer
    # and no optimizer state, and stay bit-identical.
    freeze: list[str] = field(default_factory=list)
    # LoRA adapters (rank 0 = off); with them every base weight is frozen.
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @property
    def vision_token_ids(self) -> tuple[int, int]:
        """The placeholder ids whose embeddings the vision encoder's features replace (image, video)."""
        return self.image_token_id, self.video_token_id
