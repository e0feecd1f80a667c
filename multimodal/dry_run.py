"""``pretrain_multimodal.py --dry-run``: check a recipe's parallel layout and size it per GPU, without GPUs.

    python pretrain_multimodal.py --config configs/qwen35_vl_397b_a17b.yaml --dry-run [--world-size N]

What it does, on a laptop, in well under a second:
1. Validates the layout: ``multimodal.config.validate`` (every recipe rule) plus the divisibility
   rules of a TP x PP x CP x EP x DP layout (``check_layout``), each refusal a ``ConfigError``
   naming the field and the fix. A refusal only because the trainer does not support a layout
   yet (validate's "... not implemented yet") is reported as a note, not an error: a dry run
   checks the layout arithmetic of the target run.
2. Counts the parameters every rank holds, exactly, from the recipe's shapes (``stage_params``,
   the model family's count: ``ModelFamily.stage_params``, e.g. models/qwen35_vl/param_counts.py):
   the model is not built. Meta-device construction of megatron-core modules needs real process
   groups of the target size; instead the count mirrors what megatron-core and our modules
   allocate, and tests/test_dry_run.py proves it equal to ``sum(p.numel())`` of the real model
   (dense and MoE proxies, TP/PP/EP = 1 and 2).
3. Estimates memory per GPU (``stage_memory``): bf16 weights, the fp32 gradient buffer, the fp32
   main params + Adam moments (sharded over data-parallel ranks by the distributed optimizer),
   activations of the micro-batches a 1F1B pipeline keeps in flight (bytes per token of each
   decoder layer kind and per image patch: the model family's), and a fixed overhead.

World size: ``--world-size``, else ``parallel.world_size`` from the recipe (the GPUs the layout
is designed for), else the smallest world the layout fits (tp*pp*lcm(cp, ep), data-parallel 1
or the EP span).

Layout conventions (those of megatron-core as this trainer sets it up):
- Decoder layers are split evenly over PP stages (``num_layers / pp`` each, megatron's default),
  or as ``parallel.first_stage_layers`` / ``last_stage_layers`` say; under ``parallel.vpp`` each
  rank's layers are split over its virtual stages (``ParallelConfig.chunk_layers``, megatron's
  split) and its activations are those the interleaved schedule keeps per chunk. The embedding and
  the vision encoder live on the first stage (its first chunk), the final norm and the output
  layer on the last (its last chunk). With tied embeddings and pp > 1 the last stage holds its own copy of the
  embedding matrix as the output weight (megatron keeps the two in sync).
- Tensor parallel shards the vocabulary and the decoder's projections; what each layer kind
  shards or replicates is the family's count (models/qwen35_vl/param_counts.py says it for Qwen3.5).
- Experts: ``num_experts / ep`` per rank, each sharded over expert-TP = tp (megatron's default
  ``expert_tensor_parallel_size``; the trainer does not change it). The expert data-parallel
  group is ``world / (pp * tp * ep)``; dense parameters are data-parallel over ``dp * cp``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from models import get_model_family
from models.common.fp8 import transient_bytes as fp8_transient_bytes
from models.family import StageParams
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
# a pipeline stage this far above the mean of the stages is reported: the pipeline runs at the pace
# of its busiest stage, and its fullest GPU sets the memory the layout needs
IMBALANCE = 0.20


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
    vpp: int = 1
    # global decoder-layer indices of every model chunk, [pp rank][virtual stage]
    chunks: tuple = ()
    uneven: bool = False  # parallel.first_stage_layers / last_stage_layers set

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations a 1F1B stage holds at its peak (pp - stage, capped). The
        MoE all-to-all overlap runs micro-batch i+1's forward beside i's backward: one more."""
        extra = 1 if self.moe_a2a_overlap else 0
        return min(self.pp - stage + extra, self.num_microbatches)

    def chunk_in_flight(self, stage: int) -> list[int]:
        """Under vpp: per model chunk of pipeline rank ``stage``, the micro-batches whose activations
        it holds when the interleaved schedule's warm-up ends (its peak): megatron runs
        2 (pp - 1 - stage) + (vpp - 1) pp + 1 forwards first, chunk by chunk in groups of pp
        micro-batches (get_pp_rank_microbatches, get_schedule_table)."""
        total = self.num_microbatches * self.vpp
        forwards = min(2 * (self.pp - 1 - stage) + (self.vpp - 1) * self.pp + 1, total)
        held = [0] * self.vpp
        for k in range(forwards):
            held[(k // self.pp) % self.vpp] += 1
        return held


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
            flat.parallel.cp = flat.parallel.pp = flat.parallel.vpp = 1
            flat.parallel.first_stage_layers = flat.parallel.last_stage_layers = None
            validate(flat, world_size // (p.pp * p.cp))
    validate_layout(m, p)

    model_parallel = p.tp * p.pp * p.cp
    _require(world_size % model_parallel == 0,
             f"world size {world_size} is not divisible by parallel.tp*pp*cp = {model_parallel}; "
             "change parallel.world_size / --world-size or the parallel layout")
    dp = world_size // model_parallel
    _require(m.vocab_size % p.tp == 0,
             f"model.vocab_size ({m.vocab_size}) must be divisible by parallel.tp ({p.tp}) "
             "(vocab-parallel embedding and output layer)")
    heads_per_tp = m.num_attention_heads // p.tp
    _require(heads_per_tp % p.cp == 0,
             f"model.num_attention_heads / parallel.tp ({heads_per_tp}) must be divisible by "
             f"parallel.cp ({p.cp}) for head-parallel (all-to-all) context parallelism; lower parallel.cp "
             "or parallel.tp")
    # (the family's own shapes, e.g. its fused projections and experts against tp, were checked by
    # validate_layout above: ModelFamily.validate)
    _require(m.num_experts or m.ffn_hidden_size % p.tp == 0,
             f"model.ffn_hidden_size ({m.ffn_hidden_size}) must be divisible by parallel.tp ({p.tp})")
    etp = p.tp  # expert-TP = tp (megatron's default)
    edp = 1
    if m.num_experts:
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
    p.check_pipeline(m.num_layers, mb)  # layers per rank and virtual stage; micro-batches under vpp
    if p.pp > 1 and mb < p.pp:
        notes.append(f"{mb} micro-batches per step < parallel.pp ({p.pp}): the pipeline never fills; "
                     f"raise train.global_batch_size to >= {p.pp * t.micro_batch_size * dp}")
    if p.use_distributed_optimizer and dp * p.cp == 1 and edp <= 1:
        notes.append("parallel.use_distributed_optimizer with one data-parallel rank shards nothing")
    layout = Layout(world_size, p.tp, p.pp, p.cp, p.ep, dp, etp, edp, bool(p.sequence_parallel and p.tp > 1),
                    p.use_distributed_optimizer, mb, bool(p.moe_a2a_overlap), p.vpp,
                    tuple(tuple(rank) for rank in p.chunk_layers(m.num_layers)),
                    p.first_stage_layers is not None or p.last_stage_layers is not None)
    return layout, notes


# ---------------------------------------------------------------- parameters


def stage_params(m, tp: int = 1, pp: int = 1, ep: int = 1, stage: int = 0) -> StageParams:
    """Parameters one rank of pipeline stage ``stage`` holds (every TP/CP/EP/DP rank of a stage
    holds as many): the model family's count."""
    return get_model_family(m.name).stage_params(m, tp, pp, ep, stage)


def _summed(stage: int, parts: list[StageParams]) -> StageParams:
    def add(dicts):
        out: dict = {}
        for d in dicts:
            for k, v in d.items():
                out[k] = out.get(k, 0) + v
        return out

    return StageParams(stage, add(x.layers for x in parts), add(x.parts for x in parts),
                       sum(x.expert for x in parts), sum(x.frozen for x in parts), sum(x.frozen_expert for x in parts))


def chunk_params(m, lay: Layout, stage: int) -> list[StageParams]:
    """Parameters of each model chunk (virtual stage) of pipeline rank ``stage`` on one GPU.

    The family counts an even split (``stage_params(m, tp, pp, ep, stage)``); a chunk of any layer
    range is the sum of its layers counted as one-layer stages (pp = num_layers): layer 0's count
    carries the vision encoder and the embedding, the last layer's the final norm, the output layer
    and MTP, which is where megatron puts them (the first chunk of the first rank holds layer 0, the
    last chunk of the last rank the last layer)."""
    n = m.num_layers
    return [_summed(stage, [stage_params(m, lay.tp, n, lay.ep, i) for i in layers]) for layers in lay.chunks[stage]]


def rank_params(m, lay: Layout, stage: int) -> StageParams:
    """Parameters one GPU of pipeline rank ``stage`` holds: the family's count of an even split, or
    the sum of the rank's chunks under vpp or uneven first/last stages."""
    if lay.vpp == 1 and not lay.uneven:
        return stage_params(m, lay.tp, lay.pp, lay.ep, stage)
    return _summed(stage, chunk_params(m, lay, stage))


def model_params(m) -> tuple[int, int]:
    """(total, active per token) parameters of the whole model, each weight counted once."""
    return get_model_family(m.name).model_params(m)


# ---------------------------------------------------------------- memory


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
        g = d.mock
        side = (g.min_image_side + g.max_image_side) / 2 / unit
        img = (g.min_images + g.max_images) / 2 * side**2
        return img / (img + (g.min_text_tokens + g.max_text_tokens) / 2 + g.reply_text_tokens)
    img = (d.min_pixels + d.max_pixels) / 2 / unit**2
    return img / (img + 256)


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
    """GiB per GPU of one pipeline stage (the activation terms per layer kind and per image patch
    are the model family's: ``activation_bytes_per_token``, ``vision_bytes_per_patch``)."""
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
    family = get_model_family(m.name)
    tokens = t.micro_batch_size * t.seq_length / lay.cp  # tokens of one micro-batch on this rank
    per_tok = family.activation_bytes_per_token(m, lay)

    def per_microbatch(layers: dict, embeds: bool) -> float:
        act = tokens * sum(n * per_tok[kind] for kind, n in layers.items())
        if embeds:
            frac = image_fraction(cfg) if img_fraction is None else img_fraction
            # every TP and CP rank of the first stage encodes all images of the micro-batch
            patches = frac * t.micro_batch_size * t.seq_length * m.vision.spatial_merge_size**2
            lora_on = getattr(getattr(m, "lora", None), "rank", 0)
            if "vision" not in getattr(m, "freeze", ()) and not lora_on:  # a frozen ViT keeps nothing for backward
                act += patches * family.vision_bytes_per_patch(m)
            act += tokens * 2 * m.hidden_size  # embeddings
        return act

    if lay.vpp > 1:  # each chunk holds its own micro-batches in flight (vision + embedding on chunk 0 of stage 0)
        held = lay.chunk_in_flight(sp_.stage)
        chunks = chunk_params(m, lay, sp_.stage)
        act = sum(per_microbatch(c.layers, sp_.stage == 0 and v == 0) * n for v, (c, n) in enumerate(zip(chunks, held)))
        in_flight = sum(held)
        received = in_flight - (held[0] if sp_.stage == 0 else 0)  # micro-batches a chunk got from another stage
    else:
        in_flight = lay.in_flight(sp_.stage)
        act = per_microbatch(sp_.layers, sp_.stage == 0) * in_flight
        received = in_flight if sp_.stage > 0 else 0
    depth = getattr(m, "mtp_num_layers", 0) or 0
    if depth and lay.pp > 1:
        # the MTP input embeddings travel after the hidden states (models/base.py): the tensor a
        # stage received is kept for its backward, one [S, B, H] block more per depth
        act += received * tokens * depth * m.hidden_size * BF16 / (lay.tp if lay.sequence_parallel else 1)
    if getattr(t, "fp8", None):  # the per-GEMM fp8 casts of train.fp8, one GEMM at a time
        act += fp8_transient_bytes(m, tokens, lay.tp)
    if sp_.stage == lay.pp - 1:
        if getattr(m, "fused_linear_ce", False):
            # fused_kernels/fused_linear_ce.py keeps fp32 lse per token; logits exist one ~2**27 chunk at a
            # time (bf16 + fp32 + fp32 gradient)
            act += tokens * FP32 + 2**27 * (BF16 + 2 * FP32)
        else:
            # bf16 logits + the fp32 copy megatron's vocab-parallel cross entropy keeps, and the fp32
            # logits gradient its backward makes (one micro-batch at a time)
            act += tokens * (BF16 + 2 * FP32) * m.vocab_size / lay.tp
    return StageMemory(weights / GIB, grads / GIB, optim / GIB, act / GIB, in_flight, overhead_gib)


# ---------------------------------------------------------------- pipeline


def stage_gemm_flops(cfg: Config, lay: Layout, sp_: StageParams, img_fraction: float | None = None) -> float:
    """Forward matrix-multiply FLOPs of one micro-batch on one GPU of a stage, 2 x (parameters a
    token passes through) x tokens: its decoder layers on its share of the row (routed experts at
    top-k of them, dispatched evenly over the EP ranks), the LM head on the last stage, and on the
    first the vision encoder on every patch of the micro-batch (each TP and CP rank encodes them
    all). The embedding is a lookup. Attention's score FLOPs are left out: attention layers are
    spread over the stages like the others. The step runs at the pace of the stage with the most."""
    m, t = cfg.model, cfg.train
    tokens = t.micro_batch_size * t.seq_length / lay.cp
    parts = dict(sp_.parts)
    parts.pop("embedding", None)
    vision = parts.pop("vision", 0)
    experts = parts.pop("experts", 0)
    routed = experts * m.moe_router_topk * lay.ep / m.num_experts if m.num_experts else 0
    flops = 2 * (sum(parts.values()) + routed) * tokens
    if vision:
        frac = image_fraction(cfg) if img_fraction is None else img_fraction
        flops += 2 * vision * frac * t.micro_batch_size * t.seq_length * m.vision.spatial_merge_size**2
    return flops


def bubble_fraction(pp: int, microbatches: int, vpp: int = 1) -> float:
    """Idle share of a 1F1B step with equal stage times. Non-interleaved: a step takes m + pp - 1
    micro-batch slots per stage, of which pp - 1 are the pipeline filling and draining. Interleaved
    (vpp chunks per rank, each 1/vpp of a slot): the fill and drain shrink to (pp - 1) / vpp slots,
    so the share is (pp - 1) / (vpp m + pp - 1) (Narayanan et al. 2021, section 2.2.2)."""
    if pp <= 1 or microbatches < 1:
        return 0.0
    return (pp - 1) / (vpp * microbatches + pp - 1)


def above_mean(values: list[float], limit: float = IMBALANCE) -> list[tuple[int, float]]:
    """(stage, share above the mean) of every stage more than ``limit`` above the mean of ``values``."""
    mean = sum(values) / len(values) if values else 0.0
    return [(i, v / mean - 1) for i, v in enumerate(values) if mean > 0 and v > (1 + limit) * mean]


def pipeline_report(lay: Layout, stages: list[StageParams], mems: list[StageMemory],
                    flops: list[float] | None = None) -> list[str]:
    """The pipeline lines of the dry run (the table above them has each stage's parameters and
    activations): the bubble, and a warning for every stage more than IMBALANCE above the mean of
    the stages in parameters, in memory or in matmul FLOPs per micro-batch (``flops``)."""
    if lay.pp == 1:
        return ["pipeline: pp=1, no bubble"]
    if lay.vpp > 1:
        lines = [f"pipeline: interleaved 1F1B over {lay.pp} stages x {lay.vpp} virtual stages, {lay.num_microbatches} "
                 f"micro-batches per step per DP rank: bubble (pp-1)/(vpp*m+pp-1) = "
                 f"{bubble_fraction(lay.pp, lay.num_microbatches, lay.vpp):.1%} of the step "
                 f"(non-interleaved: {bubble_fraction(lay.pp, lay.num_microbatches):.1%})"]
    else:
        lines = [f"pipeline: 1F1B over {lay.pp} stages, {lay.num_microbatches} micro-batches per step per DP rank: "
                 f"bubble (pp-1)/(m+pp-1) = {bubble_fraction(lay.pp, lay.num_microbatches):.1%} of the step"]
    checks = (("holds", "parameters", [st.total for st in stages], _fmt_params,
               "the busiest stage sets the step time"),
              ("needs", "of memory", [mem.total for mem in mems], lambda v: f"{v:.1f} GiB",
               "the fullest GPU sets the memory the layout needs"))
    if flops is not None:
        checks += (("computes", "matmul FLOPs per micro-batch", flops, lambda v: f"{v / 1e12:.1f}T",
                    "the busiest stage sets the step time"),)
    for verb, what, values, fmt, why in checks:
        mean = sum(values) / len(values)
        for stage, excess in above_mean(values):
            lines.append(f"warning: stage {stage} {verb} {fmt(values[stage])} {what}, {excess:.0%} above the "
                         f"mean of the stages ({fmt(mean)}): {why}")
    return lines


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
    vis = stage_params(m).parts.get("vision", 0)
    stages = [rank_params(m, lay, s) for s in range(lay.pp)]
    mems = [stage_memory(cfg, lay, s, overhead_gib, img_fraction) for s in stages]

    out(f"dry run {config_path}: {m.name}, world size {world}")
    out(f"  layout: tp={lay.tp} pp={lay.pp} cp={lay.cp} dp={lay.dp} | experts: ep={lay.ep} etp={lay.etp} "
        f"edp={lay.edp} | sequence_parallel={lay.sequence_parallel} "
        f"distributed_optimizer={lay.distributed_optimizer}")
    if lay.vpp > 1 or lay.uneven:
        split = " | ".join(f"{r}: " + " ".join(f"{c.start}" if len(c) == 1 else f"{c.start}-{c.stop - 1}" for c in rank)
                           for r, rank in enumerate(lay.chunks))
        out(f"  decoder layers per pipeline rank{' (one range per virtual stage)' if lay.vpp > 1 else ''}: {split}")
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
        f"{' / DP' if lay.distributed_optimizer else ''}, activations x micro-batches in flight ("
        f"{'interleaved 1F1B, counted per virtual stage' if lay.vpp > 1 else '1F1B'}, "
        f"no recompute, image tokens {frac:.0%} of a row on average), {overhead_gib:g} GiB overhead")
    if cfg.train.fp8:
        out(f"  train.fp8={cfg.train.fp8}: master weights, gradients and optimizer state unchanged; activations "
            f"include the per-GEMM fp8 casts (no fp8 weight copies are kept between GEMMs)")
    header = (f"  {'stages':<8}{'layers':>10}{'params':>10}{'experts':>10}{'weights':>9}{'grads':>8}"
              f"{'optim':>8}{'activ':>8}{'x mb':>6}{'total':>8}  fits {gpu_mem_gib:g}")
    out(header)
    worst = 0.0
    for first_s, last_s in _groups(stages, mems):
        sp_, mem = stages[first_s], mems[first_s]
        name = f"{first_s}" if first_s == last_s else f"{first_s}-{last_s}"
        layers = "+".join(f"{n}{kind[0]}" for kind, n in sp_.layers.items())  # e.g. 6g+2a: 6 GDN, 2 attention
        fits = "yes" if mem.total <= gpu_mem_gib else "NO"
        worst = max(worst, mem.total)
        out(f"  {name:<8}{layers:>10}{_fmt_params(sp_.total):>10}{_fmt_params(sp_.expert):>10}"
            f"{mem.weights:>9.1f}{mem.grads:>8.1f}{mem.optimizer:>8.1f}{mem.activations:>8.1f}"
            f"{mem.in_flight:>6}{mem.total:>8.1f}  {fits}")
    for sp_ in {stages[0].stage: stages[0], stages[-1].stage: stages[-1]}.values():  # first, last
        parts = ", ".join(f"{k} {_fmt_params(v)}" for k, v in sp_.parts.items() if v)
        out(f"  stage {sp_.stage} per rank: {parts}")
    flops = [stage_gemm_flops(cfg, lay, s, img_fraction) for s in stages]
    if lay.pp > 1:
        out("  forward matmul TFLOPs per micro-batch per GPU, by stage: "
            + " ".join(f"{f / 1e12:.1f}" for f in flops))
    for line in pipeline_report(lay, stages, mems, flops):
        out(f"  {line}")
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
        key = (s.parts, s.layers, round(mem.total, 3))
        if rows and i - 1 == rows[-1][1]:
            j = rows[-1][0]
            prev = (stages[j].parts, stages[j].layers, round(mems[j].total, 3))
            if prev == key:
                rows[-1] = (j, i)
                continue
        rows.append((i, i))
    return rows
