"""``pretrain_multimodal.py --dry-run``: check a recipe's parallel layout and size it per GPU, without GPUs.

    python pretrain_multimodal.py --config configs/qwen35_vl_397b_a17b.yaml --dry-run [--world-size N]

What it does, on a laptop, in well under a second:
1. Validates the layout: ``multimodal.config.validate`` (every recipe rule) plus the divisibility
   rules of a TP x PP x CP x EP x DP layout (``check_layout``), each refusal a ``ConfigError``
   naming the field and the fix. A refusal only because the trainer does not support a layout
   yet (validate's "... not implemented yet") is reported as a note, not an error: a dry run
   checks the layout arithmetic of the target run.
2. Counts the parameters every rank holds, exactly, from the recipe's shapes (``stage_params``):
   the model is not built. Meta-device construction of megatron-core modules needs real process
   groups of the target size; instead the count mirrors what megatron-core and our modules
   allocate, and tests/test_dry_run.py proves it equal to ``sum(p.numel())`` of the real model
   (dense and MoE proxies, TP/PP/EP = 1 and 2).
3. Estimates memory per GPU (``stage_memory``): bf16 weights, the fp32 gradient buffer, the fp32
   main params + Adam moments (sharded over data-parallel ranks by the distributed optimizer),
   activations of the micro-batches a 1F1B pipeline keeps in flight, and a fixed overhead.

World size: ``--world-size``, else ``parallel.world_size`` from the recipe (the GPUs the layout
is designed for), else the smallest world the layout fits (tp*pp*lcm(cp, ep), data-parallel 1
or the EP span).

Layout conventions (those of megatron-core as this trainer sets it up):
- Decoder layers are split evenly over PP stages (``num_layers / pp`` each, megatron's default);
  the embedding and the vision encoder live on the first stage, the final norm and the output
  layer on the last. With tied embeddings and pp > 1 the last stage holds its own copy of the
  embedding matrix as the output weight (megatron keeps the two in sync).
- Tensor parallel shards: the vocabulary (embedding, output layer), attention's fused
  q|gate|k|v and output projections, GDN's in_proj, conv1d, A_log, dt_bias and out_proj, the
  dense MLP and the shared expert. Replicated on every TP rank: all norms (decoder norms, q/k
  norms, the GDN gated norm), the MoE router, the shared-expert gate and the whole vision encoder.
- Experts: ``num_experts / ep`` per rank, each sharded over expert-TP = tp (megatron's default
  ``expert_tensor_parallel_size``; the trainer does not change it). The expert data-parallel
  group is ``world / (pp * tp * ep)``; dense parameters are data-parallel over ``dp * cp``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from models.qwen35_vl.config import ModelConfig
from multimodal.config import Config, ConfigError, validate, validate_layout

GIB = 1024**3
BF16, FP32 = 2, 4
# megatron DDP with grad_reduce_in_fp32 (multimodal/training.py) keeps one fp32 grad per parameter;
# Adam with bf16 params keeps fp32 main params + exp_avg + exp_avg_sq.
GRAD_BYTES = FP32
OPTIM_BYTES = 3 * FP32
# CUDA context, NCCL communicator buffers, allocator fragmentation: a rule of thumb, not measured.
DEFAULT_OVERHEAD_GIB = 5.0
NOT_IMPLEMENTED = "not implemented yet"


# ---------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int
    pp: int
    cp: int
    ep: int
    dp: int  # data-parallel size of the dense parameters (world / (tp*pp*cp))
    etp: int  # expert tensor parallel (= tp)
    edp: int  # expert data-parallel size (world / (pp*etp*ep))
    sequence_parallel: bool
    distributed_optimizer: bool
    num_microbatches: int
    moe_a2a_overlap: bool = False

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations a 1F1B stage holds at its peak (pp - stage, capped). The
        MoE all-to-all overlap runs micro-batch i+1's forward beside i's backward: one more."""
        extra = 1 if self.moe_a2a_overlap else 0
        return min(self.pp - stage + extra, self.num_microbatches)


def default_world_size(cfg: Config) -> int:
    p = cfg.parallel
    recipe = getattr(p, "world_size", None)
    if recipe:
        return recipe
    return p.tp * p.pp * math.lcm(p.cp, p.ep)


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def check_layout(cfg: Config, world_size: int) -> tuple[Layout, list[str]]:
    """Every rule a TP/PP/CP/EP/DP layout of this recipe must meet; returns the layout and notes.

    Runs the recipe's own ``validate`` first. Should it refuse cp > 1 or pp > 1 as "not implemented
    yet" (the trainer's refusals while those were being built), that becomes a note: the rest of
    validate then runs on a copy with cp = pp = 1 and the world divided accordingly (same
    data-parallel size), and the cp/pp arithmetic is checked here with the real values.
    """
    notes: list[str] = []
    m, p, t = cfg.model, cfg.parallel, cfg.train
    _require(world_size >= 1, f"--world-size must be >= 1, got {world_size}")
    try:
        validate(cfg, world_size)
    except ConfigError as e:
        if NOT_IMPLEMENTED not in str(e):
            raise
        notes.append(f"the trainer refuses this layout today ({e}); the dry run checks its arithmetic only")
        if world_size % (p.tp * p.pp * p.cp) == 0:  # else the check below names the fix
            flat = copy.deepcopy(cfg)
            flat.parallel.cp = flat.parallel.pp = 1
            validate(flat, world_size // (p.pp * p.cp))
    validate_layout(m, p)

    model_parallel = p.tp * p.pp * p.cp
    _require(world_size % model_parallel == 0,
             f"world size {world_size} is not divisible by parallel.tp*pp*cp = {model_parallel}; "
             "change parallel.world_size / --world-size or the parallel layout")
    dp = world_size // model_parallel
    _require(m.num_layers % p.pp == 0,
             f"model.num_layers ({m.num_layers}) must be divisible by parallel.pp ({p.pp}): "
             "megatron splits the decoder layers evenly over pipeline stages; choose pp among "
             f"{_divisors(m.num_layers)}")
    _require(m.vocab_size % p.tp == 0,
             f"model.vocab_size ({m.vocab_size}) must be divisible by parallel.tp ({p.tp}) "
             "(vocab-parallel embedding and output layer)")
    heads_per_tp = m.num_attention_heads // p.tp
    _require(heads_per_tp % p.cp == 0,
             f"model.num_attention_heads / parallel.tp ({heads_per_tp}) must be divisible by "
             f"parallel.cp ({p.cp}) for head-parallel (all-to-all) context parallelism; lower parallel.cp "
             "or parallel.tp")
    qkv_out = 2 * m.num_attention_heads * m.head_dim + 2 * m.num_query_groups * m.head_dim
    _require(qkv_out % p.tp == 0, f"the fused q|gate|k|v projection ({qkv_out}) must be divisible by parallel.tp")
    _require(m.num_experts or m.ffn_hidden_size % p.tp == 0,
             f"model.ffn_hidden_size ({m.ffn_hidden_size}) must be divisible by parallel.tp ({p.tp})")
    etp = p.tp
    edp = 1
    if m.num_experts:
        _require(m.moe_ffn_hidden_size % etp == 0,
                 f"model.moe_ffn_hidden_size ({m.moe_ffn_hidden_size}) must be divisible by the expert "
                 f"tensor-parallel size (= parallel.tp = {etp})")
        _require(m.moe_shared_expert_intermediate_size % p.tp == 0,
                 f"model.moe_shared_expert_intermediate_size ({m.moe_shared_expert_intermediate_size}) "
                 f"must be divisible by parallel.tp ({p.tp})")
        _require((dp * p.cp) % p.ep == 0,
                 f"parallel.ep ({p.ep}) must divide data-parallel x context-parallel ({dp} x {p.cp} = {dp * p.cp}): "
                 "experts are spread over the ranks that share one tensor/pipeline shard; "
                 "raise the world size or lower parallel.ep")
        edp = world_size // (p.pp * etp * p.ep)
    _require(t.seq_length % (2 * p.cp) == 0,
             f"train.seq_length ({t.seq_length}) must be divisible by 2*parallel.cp ({2 * p.cp}): "
             "each sequence is cut into 2*cp chunks for load-balanced context parallelism")
    if p.sequence_parallel and p.tp > 1:
        unit = 2 * p.cp * p.tp
        _require(t.seq_length % unit == 0,
                 f"train.seq_length ({t.seq_length}) must be divisible by 2*parallel.cp*parallel.tp ({unit}) "
                 "under parallel.sequence_parallel (each CP chunk is split again over TP ranks)")
    elif p.tp > 1:
        notes.append("parallel.sequence_parallel=false with tp > 1: activations of norms and residuals "
                     "are replicated on every TP rank (set parallel.sequence_parallel=true to shard them)")
    if m.num_experts and p.tp > 1 and not p.sequence_parallel:
        notes.append("MoE with tp > 1 and no sequence parallel: megatron-core recommends sequence_parallel=true")
    mb = t.global_batch_size // (t.micro_batch_size * dp) if dp else 0
    _require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
             f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
             f"train.micro_batch_size ({t.micro_batch_size}) x data-parallel size ({dp})")
    if p.pp > 1 and mb < p.pp:
        notes.append(f"{mb} micro-batches per step < parallel.pp ({p.pp}): the pipeline never fills; "
                     f"raise train.global_batch_size to >= {p.pp * t.micro_batch_size * dp}")
    if p.use_distributed_optimizer and dp * p.cp == 1 and edp <= 1:
        notes.append("parallel.use_distributed_optimizer with one data-parallel rank shards nothing")
    layout = Layout(world_size, p.tp, p.pp, p.cp, p.ep, dp, etp, edp, bool(p.sequence_parallel and p.tp > 1),
                    p.use_distributed_optimizer, mb, bool(p.moe_a2a_overlap))
    return layout, notes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---------------------------------------------------------------- parameters


def merger_params(m: ModelConfig) -> int:
    """The 2x2 patch merger: LayerNorm, fc1, fc2 (with biases)."""
    h = m.vision.hidden_size
    merged = h * m.vision.spatial_merge_size**2
    return 2 * h + (merged * merged + merged) + (merged * m.hidden_size + m.hidden_size)


def vision_params(m: ModelConfig) -> int:
    """models/qwen35_vl/vision.py: patch embed, learned positions, ViT blocks, 2x2 merger (all with biases)."""
    v = m.vision
    h, f = v.hidden_size, v.intermediate_size
    patch = v.in_channels * v.temporal_patch_size * v.patch_size**2
    block = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (f * h + f) + (h * f + h)
    return (patch * h + h) + v.num_position_embeddings * h + v.depth * block + merger_params(m)


def gdn_params(m: ModelConfig, tp: int) -> int:
    """megatron GatedDeltaNet: in_proj [q|k|v|z|beta|alpha], depthwise conv1d over q|k|v (no bias),
    A_log and dt_bias per value head, all TP-sharded; the gated out_norm (one value head wide) is
    replicated; out_proj is row-parallel."""
    qk = m.linear_num_key_heads * m.linear_key_head_dim
    v = m.linear_num_value_heads * m.linear_value_head_dim
    nv = m.linear_num_value_heads
    in_proj = m.hidden_size * (2 * qk + 2 * v + 2 * nv) // tp
    conv = (2 * qk + v) // tp * m.linear_conv_kernel_dim
    return in_proj + conv + 2 * nv // tp + m.linear_value_head_dim + v // tp * m.hidden_size


def attention_params(m: ModelConfig, tp: int) -> int:
    """Gated attention: fused q|gate|k|v (column-parallel), output projection (row-parallel), q/k norms."""
    q = m.num_attention_heads * m.head_dim
    kv = m.num_query_groups * m.head_dim
    return m.hidden_size * (2 * q + 2 * kv) // tp + q // tp * m.hidden_size + 2 * m.head_dim


def mlp_params(m: ModelConfig, tp: int, ep: int) -> tuple[int, int]:
    """(dense, expert) parameters of one layer's MLP block on one rank (SwiGLU: fc1 = [gate|up])."""
    h = m.hidden_size
    if not m.num_experts:
        return 3 * h * m.ffn_hidden_size // tp, 0
    dense = m.num_experts * h  # router, replicated
    if m.moe_shared_expert_intermediate_size:
        dense += 3 * h * m.moe_shared_expert_intermediate_size // tp + h  # shared expert + its gate
    experts = m.num_experts // ep * 3 * h * m.moe_ffn_hidden_size // tp  # expert TP = tp
    return dense, experts


def lora_params(m: ModelConfig, n_gdn: int, n_attn: int, tp: int = 1) -> int:
    """Adapter parameters on one TP rank of ``model.lora`` on ``n_gdn`` GDN and ``n_attn``
    attention layers (multimodal/lora.py's targets): rank x (in + out / tp) per column-parallel
    layer (A whole, B split), rank x (in / tp + out) per row-parallel one (A split, B whole)."""
    lora = getattr(m, "lora", None)
    if lora is None or not lora.rank:
        return 0
    h, t = m.hidden_size, set(lora.targets)
    qk = m.linear_num_key_heads * m.linear_key_head_dim
    v = m.linear_num_value_heads * m.linear_value_head_dim
    q, kv = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim
    gdn = (("in_proj" in t) * (h + (2 * qk + 2 * v + 2 * m.linear_num_value_heads) // tp)
           + ("out_proj" in t) * (v // tp + h))
    attn = ("linear_qkv" in t) * (h + (2 * q + 2 * kv) // tp) + ("linear_proj" in t) * (q // tp + h)
    if m.num_experts:
        s = m.moe_shared_expert_intermediate_size or 0
        mlp = ("shared_experts" in t) * bool(s) * (h + 2 * s // tp + s // tp + h)
    else:
        f = m.ffn_hidden_size
        mlp = ("linear_fc1" in t) * (h + 2 * f // tp) + ("linear_fc2" in t) * (f // tp + h)
    return lora.rank * (n_gdn * (gdn + mlp) + n_attn * (attn + mlp))


def stage_layers(m: ModelConfig, pp: int, stage: int) -> range:
    per = m.num_layers // pp
    return range(stage * per, (stage + 1) * per)


@dataclass
class StageParams:
    stage: int
    num_gdn: int
    num_attention: int
    parts: dict[str, int] = field(default_factory=dict)  # component -> parameters on one rank
    expert: int = 0  # of the total, parameters in routed experts (expert-data-parallel)
    frozen: int = 0  # of the total, parameters model.freeze holds still (no grad, no optimizer state)
    frozen_expert: int = 0  # of the frozen, routed-expert parameters

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def dense(self) -> int:
        return self.total - self.expert


def stage_params(m: ModelConfig, tp: int = 1, pp: int = 1, ep: int = 1, stage: int = 0) -> StageParams:
    """Parameters one rank of pipeline stage ``stage`` holds (every TP/CP/EP/DP rank of a stage holds as many)."""
    h, first, last = m.hidden_size, stage == 0, stage == pp - 1
    layers = stage_layers(m, pp, stage)
    n_attn = sum(m.is_full_attention(i) for i in layers)
    n_gdn = len(layers) - n_attn
    dense_mlp, expert_mlp = mlp_params(m, tp, ep)
    parts = {
        "embedding": m.vocab_size // tp * h if first else 0,
        "vision": vision_params(m) if first else 0,
        "gdn": n_gdn * gdn_params(m, tp),
        "attention": n_attn * attention_params(m, tp),
        "norms": len(layers) * 2 * h + (h if last else 0),
        "mlp": len(layers) * dense_mlp,
        "experts": len(layers) * expert_mlp,
        # untied: its own matrix; tied: shared with the embedding on one stage, a synced copy when pp > 1
        "output": m.vocab_size // tp * h if last and (not m.tie_word_embeddings or not first) else 0,
    }
    frozen_by_group = {
        "vision": parts["vision"] - (merger_params(m) if first else 0),
        "merger": merger_params(m) if first else 0,
        "language": sum(parts[k] for k in ("gdn", "attention", "norms", "mlp", "experts")),
        "embedding": parts["embedding"],
        "lm_head": parts["output"],
    }
    freeze = set(getattr(m, "freeze", ()))
    frozen = sum(n for g, n in frozen_by_group.items() if g in freeze)
    lora = getattr(m, "lora", None)
    if lora is not None and lora.rank:  # model.lora: every base weight frozen, the adapters train
        frozen = sum(parts.values())
        parts["lora"] = lora_params(m, n_gdn, n_attn, tp)
        return StageParams(stage, n_gdn, n_attn, parts, parts["experts"], frozen, parts["experts"])
    return StageParams(stage, n_gdn, n_attn, parts, parts["experts"], frozen,
                       parts["experts"] if "language" in freeze else 0)


def model_params(m: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameters of the whole model, each weight counted once."""
    full = stage_params(m)
    total = full.total
    active = total
    if m.num_experts:
        per_expert = 3 * m.hidden_size * m.moe_ffn_hidden_size
        active -= m.num_layers * (m.num_experts - m.moe_router_topk) * per_expert
    return total, active


# ---------------------------------------------------------------- memory


def activation_bytes_per_token(m: ModelConfig, lay: Layout) -> dict[str, float]:
    """Bytes of saved activations per token of a micro-batch for one decoder layer of each kind.

    bf16 tensors kept for backward, no recomputation; TP-sharded tensors are divided by tp,
    hidden-sized ones (norm inputs/outputs) too under sequence parallel. With a = heads,
    g = KV groups, d = head_dim, h = hidden, f = ffn, K/V = GDN key/value widths, nv = GDN value
    heads, dk = key head dim, E/k/fe/fs = experts/top-k/expert ffn/shared ffn:
      every layer    8h          two RMSNorms: input + output
      attention      12ad + 8gd  q|gate|k|v, normed q/k, rotated q/k, attention out, gated out
      GDN            8K + 14V + 4*nv*dk + 266*nv
                                  in_proj out, conv out, l2-normed q/k repeated to nv heads, v, z,
                                  core out, norm in/out, fp32 decay/beta and the chunk-64 fp32
                                  intra-chunk matrix of the delta rule
      dense MLP      8f          fc1 out [gate|up], silu(gate), product (fc2 input)
      MoE            8E + k(4h + 8fe/tp) + 8fs/tp
                                  fp32 router logits + probs; per routed copy: the permuted input
                                  (fc1's input), expert fc1/act/product, the expert output (kept to
                                  weight it by its routing prob); the shared expert. Routed
                                  copies are not divided by tp: with expert-TP the dispatcher
                                  all-gathers the TP ranks' tokens.
    Context parallel divides the tokens (each rank keeps seq/cp of every sequence; GDN's
    head-parallel all-to-all trades tokens for heads at the same byte count).
    """
    t = lay.tp
    sp = t if lay.sequence_parallel else 1
    a, g, d, h = m.num_attention_heads, m.num_query_groups, m.head_dim, m.hidden_size
    qk = m.linear_num_key_heads * m.linear_key_head_dim
    v = m.linear_num_value_heads * m.linear_value_head_dim
    nv, dk = m.linear_num_value_heads, m.linear_key_head_dim
    common = 8 * h / sp
    if m.num_experts:
        fs = m.moe_shared_expert_intermediate_size
        mlp = (8 * m.num_experts / sp + m.moe_router_topk * (4 * h + 8 * m.moe_ffn_hidden_size / t)
               + 8 * fs / t)
    else:
        mlp = 8 * m.ffn_hidden_size / t
    return {
        "attention": common + (12 * a * d + 8 * g * d) / t + mlp,
        "gdn": common + (8 * qk + 14 * v + 4 * nv * dk + 266 * nv) / t + mlp,
    }


def image_fraction(cfg: Config) -> float:
    """Mean share of a packed row that is image tokens, from the data recipe.

    A packed row holds many samples, so its image share is close to the mean. mock: images per
    sample and both image sides are uniform (data/mock.py), so the mean image tokens per sample
    is mean(images) x mean(side / 32)^2, against mean(text tokens). cord_v2: one image per
    sample, area uniform-ish in [min_pixels, max_pixels], ~256 answer + prompt tokens.
    """
    d, v = cfg.data, cfg.model.vision
    unit = v.patch_size * v.spatial_merge_size
    if d.name == "mock":
        side = (d.min_image_side + d.max_image_side) / 2 / unit
        img = (d.min_images + d.max_images) / 2 * side**2
        return img / (img + (d.min_text_tokens + d.max_text_tokens) / 2)
    img = (d.min_pixels + d.max_pixels) / 2 / unit**2
    return img / (img + 256)


def vision_bytes_per_patch(m: ModelConfig) -> float:
    """Per ViT block: two LayerNorms in/out, qkv, rotated q/k, attention out, fc1 out, gelu out."""
    h, f = m.vision.hidden_size, m.vision.intermediate_size
    return m.vision.depth * (20 * h + 4 * f)


@dataclass
class StageMemory:
    weights: float
    grads: float
    optimizer: float
    activations: float
    in_flight: int
    overhead: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.overhead


def stage_memory(cfg: Config, lay: Layout, sp_: StageParams, overhead_gib: float = DEFAULT_OVERHEAD_GIB,
                 img_fraction: float | None = None) -> StageMemory:
    """GiB per GPU of one pipeline stage (see activation_bytes_per_token for the activation terms)."""
    m, t = cfg.model, cfg.train
    weights = BF16 * sp_.total
    # frozen weights (model.freeze) have no gradient buffer and no optimizer state
    dense_trained = sp_.dense - (sp_.frozen - sp_.frozen_expert)
    expert_trained = sp_.expert - sp_.frozen_expert
    grads = GRAD_BYTES * (dense_trained + expert_trained)
    if lay.distributed_optimizer:
        optim = OPTIM_BYTES * (dense_trained / (lay.dp * lay.cp) + expert_trained / max(lay.edp, 1))
    else:
        optim = OPTIM_BYTES * (dense_trained + expert_trained)
    tokens = t.micro_batch_size * t.seq_length / lay.cp  # tokens of one micro-batch on this rank
    per_tok = activation_bytes_per_token(m, lay)
    act = tokens * (sp_.num_gdn * per_tok["gdn"] + sp_.num_attention * per_tok["attention"])
    if sp_.stage == 0:
        frac = image_fraction(cfg) if img_fraction is None else img_fraction
        # every TP and CP rank of the first stage encodes all images of the micro-batch
        patches = frac * t.micro_batch_size * t.seq_length * m.vision.spatial_merge_size**2
        lora_on = getattr(getattr(m, "lora", None), "rank", 0)
        if "vision" not in getattr(m, "freeze", ()) and not lora_on:  # a frozen ViT keeps nothing for backward
            act += patches * vision_bytes_per_patch(m)
        act += tokens * 2 * m.hidden_size  # embeddings
    in_flight = lay.in_flight(sp_.stage)
    act *= in_flight
    if sp_.stage == lay.pp - 1:
        if getattr(m, "fused_linear_ce", False):
            # kernels/fused_linear_ce.py keeps fp32 lse per token; logits exist one ~2**27 chunk at a
            # time (bf16 + fp32 + fp32 gradient)
            act += tokens * FP32 + 2**27 * (BF16 + 2 * FP32)
        else:
            # bf16 logits + the fp32 copy megatron's vocab-parallel cross entropy keeps, and the fp32
            # logits gradient its backward makes (one micro-batch at a time)
            act += tokens * (BF16 + 2 * FP32) * m.vocab_size / lay.tp
    return StageMemory(weights / GIB, grads / GIB, optim / GIB, act / GIB, in_flight, overhead_gib)


# ---------------------------------------------------------------- report


def _fmt_params(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def dry_run(cfg: Config, world_size: int | None = None, gpu_mem_gib: float = 80.0,
            overhead_gib: float = DEFAULT_OVERHEAD_GIB, img_fraction: float | None = None, out=print,
            config_path: str = "") -> int:
    """Validate, count, estimate, print. Returns 0 when every rank fits ``gpu_mem_gib``, 1 when not;
    raises ConfigError for an impossible layout."""
    world = world_size or default_world_size(cfg)
    lay, notes = check_layout(cfg, world)
    m = cfg.model
    total, active = model_params(m)
    vis = vision_params(m)
    stages = [stage_params(m, lay.tp, lay.pp, lay.ep, s) for s in range(lay.pp)]
    mems = [stage_memory(cfg, lay, s, overhead_gib, img_fraction) for s in stages]

    out(f"dry run {config_path}: {m.name}, world size {world}")
    out(f"  layout: tp={lay.tp} pp={lay.pp} cp={lay.cp} dp={lay.dp} | experts: ep={lay.ep} etp={lay.etp} "
        f"edp={lay.edp} | sequence_parallel={lay.sequence_parallel} "
        f"distributed_optimizer={lay.distributed_optimizer}")
    if m.freeze:
        out(f"  frozen (model.freeze={list(m.freeze)}): {_fmt_params(sum(s.frozen for s in stages))} parameters "
            f"on the first rank of each stage keep no gradient and no optimizer state")
    if m.lora.rank:
        out(f"  LoRA (model.lora rank {m.lora.rank}): {_fmt_params(sum(s.parts['lora'] for s in stages))} adapter "
            f"parameters train; {_fmt_params(sum(s.frozen for s in stages))} base parameters on the first rank "
            f"of each stage are frozen (no gradient, no optimizer state)")
    out(f"  batch: {cfg.train.global_batch_size} x {cfg.train.seq_length} tokens per step, micro-batch "
        f"{cfg.train.micro_batch_size}, {lay.num_microbatches} micro-batches per DP rank per step")
    active_s = f", active per token {_fmt_params(active)}" if m.num_experts else ""
    out(f"  parameters: total {_fmt_params(total)} (language {_fmt_params(total - vis)}, vision "
        f"{_fmt_params(vis)}){active_s}")
    frac = image_fraction(cfg) if img_fraction is None else img_fraction
    out(f"  memory per GPU in GiB: bf16 weights, fp32 grads, fp32 main params + Adam m/v"
        f"{' / DP' if lay.distributed_optimizer else ''}, activations x micro-batches in flight (1F1B, "
        f"no recompute, image tokens {frac:.0%} of a row on average), {overhead_gib:g} GiB overhead")
    header = (f"  {'stages':<8}{'layers':>10}{'params':>10}{'experts':>10}{'weights':>9}{'grads':>8}"
              f"{'optim':>8}{'activ':>8}{'x mb':>6}{'total':>8}  fits {gpu_mem_gib:g}")
    out(header)
    worst = 0.0
    for first_s, last_s in _groups(stages, mems):
        sp_, mem = stages[first_s], mems[first_s]
        name = f"{first_s}" if first_s == last_s else f"{first_s}-{last_s}"
        layers = f"{sp_.num_gdn}g+{sp_.num_attention}a"
        fits = "yes" if mem.total <= gpu_mem_gib else "NO"
        worst = max(worst, mem.total)
        out(f"  {name:<8}{layers:>10}{_fmt_params(sp_.total):>10}{_fmt_params(sp_.expert):>10}"
            f"{mem.weights:>9.1f}{mem.grads:>8.1f}{mem.optimizer:>8.1f}{mem.activations:>8.1f}"
            f"{mem.in_flight:>6}{mem.total:>8.1f}  {fits}")
    for sp_ in {stages[0].stage: stages[0], stages[-1].stage: stages[-1]}.values():  # first, last
        parts = ", ".join(f"{k} {_fmt_params(v)}" for k, v in sp_.parts.items() if v)
        out(f"  stage {sp_.stage} per rank: {parts}")
    for note in notes:
        out(f"  note: {note}")
    if worst > gpu_mem_gib:
        out(f"  DOES NOT FIT: {worst:.1f} GiB > {gpu_mem_gib:g} GiB on the fullest GPU; raise tp/pp/ep/cp, "
            "enable parallel.use_distributed_optimizer, lower train.seq_length, or set train.recompute_modules "
            "(not counted here: this estimate assumes no recompute)")
        return 1
    out(f"  OK: layout valid, fullest GPU {worst:.1f} of {gpu_mem_gib:g} GiB")
    return 0


def _groups(stages: list[StageParams], mems: list[StageMemory]) -> list[tuple[int, int]]:
    """Runs of consecutive stages with identical rows (first, middle..., last collapse to ~3 rows)."""
    rows: list[tuple[int, int]] = []
    for i, (s, mem) in enumerate(zip(stages, mems)):
        key = (s.parts, s.num_gdn, s.num_attention, round(mem.total, 3))
        if rows and i - 1 == rows[-1][1]:
            j = rows[-1][0]
            prev = (stages[j].parts, stages[j].num_gdn, stages[j].num_attention, round(mems[j].total, 3))
            if prev == key:
                rows[-1] = (j, i)
                continue
        rows.append((i, i))
    return rows
