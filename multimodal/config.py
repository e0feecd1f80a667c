"""Typed training recipe: dataclass sections, loading (multimodal/recipe_reader.py reads the YAML,
bases, dotted overrides and renamed keys), validation.

    cfg = load_config("configs/qwen35_vl_proxy.yaml", ["train.iters=50", "model.vision.depth=1"])

A recipe may name a base recipe (``base: base/qwen35_vl.yaml``, relative to its folder; bases may
have bases) whose sections it overrides key by key; the command-line overrides come last.
Unknown keys and badly typed values raise ``ConfigError`` naming the dotted field;
``validate(cfg, world_size)`` checks the cross-field rules at start-up.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from core.errors import ConfigError  # noqa: F401 - re-exported: callers import it from here
from data.config import DataConfig, conversations_path  # noqa: F401 - DataConfig re-exported
# the model and parallel sections live below the trainer, beside the model builder that reads them;
# the model section's class is the one of the family model.name names (models.MODEL_REGISTRY)
from models import DEFAULT_MODEL, get_hf_adapter, get_model_family
from models.common.attention import BACKENDS as ATTENTION_BACKENDS
from models.common.fp8 import DEFAULT_EXCLUDE as FP8_DEFAULT_EXCLUDE, RECIPES as FP8_RECIPES
from models.common.model_config import ModelConfig
from models.common.parallel_config import ParallelConfig
from multimodal.recipe_reader import SECTION_CLASS, build_section, dotted_keys, read_raw

log = logging.getLogger(__name__)


@dataclass
class CudaGraphsConfig:
    """Decoder layers replayed as CUDA graphs, forward and backward (models/performance/layer_graphs.py):
    removes most of the host's kernel-launch time. GPU, packed rows, pp=tp=cp=1, no recompute.
    MoE decoder layers stay eager (only the vision encoder's graphs run; recompute allowed)."""

    enabled: bool = False  # replay the layers as CUDA graphs (GPU only)
    # samples per packed row (decoder) and images per micro-batch (vision) a graph holds; rows
    # with more run eagerly (counted)
    max_samples: int = 64
    # The vision encoder too (where its family has graphs: ModelFamily.vision_graph_buckets): its
    # input padded up to a bucket of patches (multiples of this many up to 8 of them, then 8 sizes
    # per doubling: at most 1/8 padding), one graph pair per bucket. 0 = vision eager.
    vision_bucket: int = 1024
    vision_max_buckets: int = 24  # vision buckets captured at most; further sizes run eagerly (counted)
    # Capture every vision bucket up to this many patches at the first micro-batch, so no later
    # step stops to capture one (0 = capture each bucket when first seen; -1 = the most a
    # micro-batch can hold, micro_batch_size x seq_length x spatial_merge_size^2).
    vision_warmup_patches: int = 0
    # The backward graphs add the parameter gradients into DDP's main_grad themselves (megatron's
    # grad_added_to_main_grad convention), instead of returning static gradients that autograd
    # copies and DDP's hook then adds in one launch per parameter. false: the latter.
    grads_to_main_grad: bool = True

    def validate(self, spatial_merge_size: int) -> None:
        """Its own fields, when graphs are on."""
        if not self.enabled:
            return
        merge2 = spatial_merge_size**2
        _require(self.max_samples >= 1, f"train.cuda_graphs.max_samples must be >= 1, got {self.max_samples}")
        _require(self.vision_bucket >= 0 and self.vision_bucket % merge2 == 0,
                 "train.cuda_graphs.vision_bucket must be 0 (vision eager) or a positive multiple of "
                 f"model.vision.spatial_merge_size^2 = {merge2}, got {self.vision_bucket}")
        _require(self.vision_max_buckets >= 1,
                 f"train.cuda_graphs.vision_max_buckets must be >= 1, got {self.vision_max_buckets}")
        _require(self.vision_warmup_patches >= -1, "train.cuda_graphs.vision_warmup_patches must be >= 0, "
                 "or -1 for the most a micro-batch can hold")


@dataclass
class TrainConfig:
    iters: int = 30  # optimizer steps
    micro_batch_size: int = 1  # rows per forward; 1 with data.pack (one packed row)
    global_batch_size: int = 4  # rows per optimizer step, over all data-parallel ranks
    seq_length: int = 512  # tokens per row
    seed: int = 1234  # the initial weights (model.init) and the run's random draws
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    # megatron-core's deterministic_mode plus torch's deterministic kernels where they exist (the
    # MoE combine, scatter/index ops); slower. Kernels without such a version (flash attention's
    # and fla's backward) still vary in the last bits from run to run.
    deterministic: bool = False
    # selective activation recompute (multimodal/performance/recompute.py): core_attn, layernorm,
    # shared_experts, moe_act, gdn_qkv, gdn_norm_out; outputs and gradients unchanged bit for bit
    recompute_modules: list[str] = field(default_factory=list)
    # decoder (and vision) layers replayed as CUDA graphs; `train.cuda_graphs: true|false` is
    # shorthand for train.cuda_graphs.enabled
    cuda_graphs: CudaGraphsConfig = field(default_factory=CudaGraphsConfig)
    # A step whose gradient norm is not finite (NaN/inf loss or gradients) never updates the
    # weights: the optimizer's kernels skip it on the device, no host sync (multimodal/nonfinite.py).
    # skip: count it and go on, stop after max_nonfinite_steps in a row; stop: stop at the first.
    # Either is noticed at the next log step (logging.interval) or checkpoint.
    on_nonfinite: str = "skip"
    max_nonfinite_steps: int = 10  # with on_nonfinite=skip: stop after this many non-finite steps in a row
    # validation loss (multimodal/evaluation.py) every eval_interval steps and after the last step
    # (0 = off), over eval_iters global batches (train.global_batch_size rows each) of the
    # validation data (data.valid_path), the same batches at every evaluation; each sample at most
    # once (rows past the set's end are blank, never repeats)
    eval_interval: int = 0
    eval_iters: int = 10  # global batches per evaluation
    # FP8 GEMMs in the decoder's linear layers and routed experts (models/common/fp8.py, docs/fp8.md):
    # null (bf16) | tensorwise | rowwise, torchao's recipe names. fp8_exclude: module-name patterns
    # (fnmatch) kept in bf16; the default keeps the vision tower, the routers, the LM head, the
    # embeddings and GDN's beta/alpha rows of in_proj (<layer>.self_attention.in_proj_ba)
    fp8: str | None = None
    fp8_exclude: list[str] = field(default_factory=lambda: list(FP8_DEFAULT_EXCLUDE))
    # compiled GPU kernels and autotune choices (Triton, TileLang, inductor) are kept here and reused
    # by later runs; a folder on a shared file system serves every node (core/kernel_cache.py).
    # null: each library's own default folder
    kernel_cache: str | None = "~/.cache/qwen35-vl/kernels"

    def validate(self) -> None:
        for key in ("iters", "micro_batch_size", "global_batch_size", "seq_length"):
            _require(getattr(self, key) >= 1, f"train.{key} must be >= 1, got {getattr(self, key)}")
        _require(self.precision in ("auto", "bf16", "fp32"),
                 f"train.precision must be auto|bf16|fp32, got {self.precision!r}")
        _require(self.on_nonfinite in ("skip", "stop"),
                 f"train.on_nonfinite must be skip|stop, got {self.on_nonfinite!r}")
        _require(self.max_nonfinite_steps >= 1,
                 f"train.max_nonfinite_steps must be >= 1, got {self.max_nonfinite_steps}")
        _require(self.eval_interval >= 0, "train.eval_interval must be >= 0 (steps between evaluations; 0 = no "
                                          f"validation), got {self.eval_interval}")
        _require(self.eval_iters >= 1,
                 f"train.eval_iters must be >= 1 (global batches per evaluation), got {self.eval_iters}")
        _require(self.fp8 is None or self.fp8 in FP8_RECIPES,
                 f"train.fp8 must be null (bf16), tensorwise or rowwise, got {self.fp8!r}")


@dataclass
class OptimizerConfig:
    name: str = "adam"  # AdamW (decoupled weight decay)
    lr: float = 1e-3  # peak learning rate, after the warm-up
    min_lr: float = 1e-4  # learning rate at the end of the decay
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # the global gradient norm is clipped to this
    warmup_iters: int = 3  # steps of linear warm-up from 0 to lr
    decay_iters: int | None = None  # default: train.iters
    lr_decay_style: str = "cosine"  # cosine | linear | constant
    fused: bool = True  # torch's fused AdamW kernel (one pass over params and state) instead of foreach
    # With the fused kernel: the 1/tokens gradient scale and the clip coefficient are applied by
    # the AdamW kernel as it reads each gradient, instead of two passes over the fp32 gradients
    # (multimodal/performance/multi_tensor.py DeferredGradScale). Same update up to rounding.
    defer_grad_scaling: bool = True
    # AdamW over flat buffers (multimodal/performance/flat_adamw_patch.py): one Triton kernel per parameter group
    # updates the fp32 main params and moments and writes the bf16 model params, in place of torch's
    # fused AdamW plus megatron's per-parameter copy. null: on with a CUDA device and Triton; true
    # elsewhere runs its PyTorch reference (slow; for tests). Also under the distributed optimizer.
    flat: bool | None = None
    # Flat AdamW's step on a second CUDA stream, behind the next step's forward: each layer waits
    # only for its own parameters, the backward for all (multimodal/performance/overlap_update.py). Same
    # update bit for bit. null: on where flat AdamW runs its kernel on a GPU (not under the
    # distributed optimizer); true on the CPU runs the same parts in order (tests).
    overlap_step: bool | None = None
    overlap_step_pieces: int = 16  # parts the update is cut into, in forward order

    def validate(self) -> None:
        _require(self.overlap_step_pieces >= 1,
                 f"optimizer.overlap_step_pieces must be >= 1, got {self.overlap_step_pieces}")
        _require(self.lr_decay_style in ("cosine", "linear", "constant"),
                 f"optimizer.lr_decay_style must be cosine|linear|constant, got {self.lr_decay_style!r}")
        # each bound on its own first: a negative lr is reported as such, not as a min_lr problem
        # lr = 0 is allowed: a run that must leave the weights as they are (checking a conversion)
        _require(self.lr >= 0, f"optimizer.lr must be >= 0, got {self.lr}")
        _require(self.min_lr >= 0, f"optimizer.min_lr must be >= 0, got {self.min_lr}")
        _require(self.min_lr <= self.lr, f"optimizer.min_lr ({self.min_lr}) must be <= optimizer.lr ({self.lr})")
        _require(not (self.overlap_step and self.flat is False),
                 "optimizer.overlap_step=true runs flat AdamW's kernel on a second stream: set optimizer.flat to "
                 "true or null, or optimizer.overlap_step to false or null")


@dataclass
class CheckpointConfig:
    dir: str | None = None  # where this run's checkpoints are written (null: none)
    interval: int = 0  # steps between checkpoints; 0: only at the end
    load: str | None = None  # a checkpoint dir, or "latest" to resume from checkpoint.dir
    save_at_end: bool = True  # a checkpoint after the last step
    keep_last: int = 0  # 0 keeps all
    # write checkpoints in a background process while training goes on (multimodal/async_saves.py);
    # null: on for GPU runs, off on the CPU
    async_save: bool | None = None
    # write into a checkpoint.dir that holds another run's checkpoints (refused otherwise, unless
    # the run resumes from them): same-numbered ones are replaced, the others kept, never pruned
    overwrite: bool = False
    # load a checkpoint without this framework's manifest.json (torch's reader unpickles its
    # .metadata, which can run code): only for files you trust
    trust: bool = False
    # a folder: the final checkpoint is also written there as Hugging Face safetensors (shards +
    # index + config.json, every rank writing its share), ready for from_pretrained or vLLM
    save_hf: str | None = None

    def validate(self) -> None:
        _require(self.interval >= 0, "checkpoint.interval must be >= 0 (0 = only at the end)")
        _require(self.load != "latest" or self.dir is not None, "checkpoint.load=latest needs checkpoint.dir")
        if self.save_hf:
            _require(self.dir is not None and self.save_at_end, "checkpoint.save_hf writes the final "
                     "checkpoint: it needs checkpoint.dir and checkpoint.save_at_end=true")


@dataclass
class LoggingConfig:
    dir: str = "runs/default"  # metrics.jsonl, TensorBoard events, profiles and memory snapshots
    interval: int = 1  # steps between log lines
    tensorboard: bool = True  # TensorBoard events under <dir>/tensorboard
    wandb: bool = False  # log to Weights & Biases too
    wandb_project: str = "qwen35-vl"
    # offline | online | disabled; null: the WANDB_MODE environment variable, else offline
    wandb_mode: str | None = None
    progress_bar: bool = True  # a tqdm bar on the console
    peak_tflops: float | None = None  # per device; default from the device name (H100/H200: 989)
    # CUDA allocator history from start-up, dumped to <dir>/memory_snapshot.pickle after step
    # memory_snapshot_step (pytorch.org/memory_viz); multimodal/observability/memory.py. No-op on CPU.
    memory_history: bool = False
    memory_snapshot_step: int = 3  # the step after which the allocator history is written
    # 0: Python's automatic GC; N: GC off, gc.collect() every N steps on every rank at once
    manual_gc_interval: int = 0
    # torch.profiler over steps profile_step .. profile_step + profile_num_steps - 1 (0 = off) on
    # profile_ranks: <dir>/profile/trace_rank{r}.json.gz + kernels_rank{r}.txt (multimodal/observability/profiling.py)
    profile_step: int = 0
    profile_num_steps: int = 2  # steps profiled
    profile_ranks: list[int] = field(default_factory=lambda: [0])  # ranks that profile
    # record Python frames too: the summary's longest idle gaps then show which code launched the
    # kernel the GPU waited for (costs more host time in the profiled steps)
    profile_with_stack: bool = False

    def validate(self) -> None:
        _require(self.interval >= 1, f"logging.interval must be >= 1, got {self.interval}")
        _require(self.memory_snapshot_step >= 1, "logging.memory_snapshot_step must be >= 1 (the step after which "
                 f"the snapshot is written), got {self.memory_snapshot_step}")
        _require(self.manual_gc_interval >= 0, "logging.manual_gc_interval must be >= 0 (0 keeps Python's "
                 f"automatic GC), got {self.manual_gc_interval}")
        _require(self.profile_step >= 0 and self.profile_num_steps >= 1,
                 "logging.profile_step must be >= 0 (0 = off) and logging.profile_num_steps >= 1, got "
                 f"{self.profile_step} and {self.profile_num_steps}")
        _require(self.wandb_mode in (None, "offline", "online", "disabled"),
                 f"logging.wandb_mode must be offline|online|disabled or null, got {self.wandb_mode!r}")


def _model_section_class(raw: Any) -> type:
    """The dataclass of the family that the ``model`` section's ``name`` names (default: DEFAULT_MODEL)."""
    name = raw.get("name", DEFAULT_MODEL) if isinstance(raw, dict) else DEFAULT_MODEL
    try:
        return get_model_family(name).config_class
    except KeyError as e:
        raise ConfigError(e.args[0]) from None


@dataclass
class Config:
    # the class of the family model.name names (models.MODEL_REGISTRY)
    model: ModelConfig = field(default_factory=lambda: get_model_family(DEFAULT_MODEL).config_class(),
                               metadata={SECTION_CLASS: _model_section_class})
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    raw = read_raw(path, overrides)
    cfg = build_section(Config, raw, "")
    cfg.given = frozenset(dotted_keys(raw))  # what the recipe or an override set, not a default
    return cfg



# ---------------------------------------------------------------- validation


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def validate(cfg: Config, world_size: int = 1) -> None:
    """Start-up checks that need no model: each section's own rules, then those across sections.
    Raises ConfigError naming the field and the fix."""
    m, t, p, d = cfg.model, cfg.train, cfg.parallel, cfg.data
    for section in (d, t, cfg.optimizer, cfg.checkpoint, cfg.logging):
        section.validate()
    t.cuda_graphs.validate(m.vision.spatial_merge_size)
    _validate_model(m)
    _validate_parallel(cfg, world_size)
    validate_layout(m, p)
    _validate_graphs(cfg)
    _validate_recompute(cfg)
    _validate_images(m, d)
    validate_eval(t, d)
    if p.moe_a2a_overlap:
        validate_moe_a2a_overlap(cfg)
    if cfg.checkpoint.save_hf:
        _require(get_model_family(m.name).hf_adapter is not None,
                 f"checkpoint.save_hf: model.name={m.name} has no Hugging Face adapter; unset checkpoint.save_hf")


def _validate_model(m: ModelConfig) -> None:
    """The model section's fields every family has (the family's own rules: validate_layout)."""
    for key in ("num_layers", "hidden_size"):
        _require(getattr(m, key) >= 1, f"model.{key} must be >= 1, got {getattr(m, key)}")
    if m.freeze:
        from multimodal.freeze import check_freeze

        why = check_freeze(m.freeze, m.tie_word_embeddings)
        _require(why is None, f"model.freeze: {why}")
    if m.lora.rank:
        from multimodal.lora import check_lora

        why = check_lora(m.lora)
        _require(why is None, f"model.lora.{why}")
    special = [m.image_token_id, m.video_token_id, m.vision_start_token_id, m.vision_end_token_id, m.im_start_token_id,
               m.im_end_token_id, m.eos_token_id, m.pad_token_id]
    _require(all(0 <= s < m.vocab_size for s in special),
             f"special token ids {special} must lie inside model.vocab_size ({m.vocab_size})")
    # a tokenizer keeps its special ids together; a video id far from the image id is the default
    # left behind in a recipe with a real vocabulary, where it is an ordinary text token
    _require(abs(m.video_token_id - m.image_token_id) < 256,
             f"model.video_token_id={m.video_token_id} is far from model.image_token_id={m.image_token_id}; set "
             "data.tokenizer (which sets both), or model.video_token_id to the tokenizer's video placeholder id, "
             "or read the model from model.hf_config")


def _validate_parallel(cfg: Config, world_size: int) -> None:
    """The parallel layout against the world size, the batch, the rows and the optimizer."""
    t, p = cfg.train, cfg.parallel
    for key in ("tp", "pp", "cp", "ep"):
        _require(getattr(p, key) >= 1, f"parallel.{key} must be >= 1, got {getattr(p, key)}")
    _require(not (cfg.optimizer.overlap_step and p.use_distributed_optimizer),
             "optimizer.overlap_step=true: the distributed optimizer all-gathers the parameters right after "
             "its step, so the step cannot run behind the next forward; set optimizer.overlap_step=null or false")
    model_parallel = p.tp * p.pp * p.cp
    _require(world_size % model_parallel == 0,
             f"world size {world_size} is not divisible by parallel.tp*pp*cp = {model_parallel}; "
             "change the parallel layout or the number of processes")
    dp = world_size // model_parallel
    _require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
             f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
             f"train.micro_batch_size ({t.micro_batch_size}) x data-parallel size ({dp})")
    if cfg.data.pack:
        _require(t.micro_batch_size == 1,
                 "data.pack=true builds one packed row of train.seq_length tokens per micro-batch; "
                 "set train.micro_batch_size=1 (raise train.seq_length for more tokens per micro-batch)")
    if p.cp > 1:
        # every sample is cut into 2*cp chunks (load-balanced zigzag); the row must split too
        multiple = 2 * p.cp * (p.tp if p.sequence_parallel and p.tp > 1 else 1)
        _require(t.seq_length % multiple == 0,
                 f"train.seq_length ({t.seq_length}) must be a multiple of 2*cp{'*tp' if multiple > 2 * p.cp else ''}"
                 f" = {multiple} under context parallelism; pick a seq_length that is")
    # layers per pipeline rank and virtual stage, micro-batches for the interleaved schedule
    p.check_pipeline(cfg.model.num_layers, t.global_batch_size // (t.micro_batch_size * dp))


def _validate_graphs(cfg: Config) -> None:
    """train.cuda_graphs against the rest of the run: what the graphs cannot replay, and the
    vision buckets its warm-up needs."""
    g = cfg.train.cuda_graphs
    if not g.enabled:
        return
    from models.performance.layer_graphs import refusal

    why = refusal(cfg.model, cfg.parallel, cfg.data.pack, cfg.train.recompute_modules, cfg.train.micro_batch_size)
    _require(why is None, f"train.cuda_graphs: {why}")
    buckets = get_model_family(cfg.model.name).vision_graph_buckets
    warmup = vision_warmup_patches(cfg)
    if warmup and g.vision_bucket and buckets is not None:
        n = len(buckets(warmup, g.vision_bucket))
        _require(n <= g.vision_max_buckets,
                 f"train.cuda_graphs.vision_warmup_patches={g.vision_warmup_patches} needs {n} vision buckets (up to "
                 f"{warmup} patches), more than train.cuda_graphs.vision_max_buckets={g.vision_max_buckets}; "
                 "raise that or lower the warm-up")


def _validate_recompute(cfg: Config) -> None:
    modules, m = cfg.train.recompute_modules, cfg.model
    if not modules:
        return
    from multimodal.performance.recompute import check_modules

    why = check_modules(modules, cfg.parallel.cp)
    _require(why is None, f"train.recompute_modules: {why}")
    has = get_model_family(m.name).recompute_modules
    lacking = [name for name in modules if name not in has]
    _require(not lacking, f"train.recompute_modules: model.name={m.name} has no {lacking}; choose from {list(has)}")


def _validate_images(m: ModelConfig, d: DataConfig) -> None:
    """The data's image sizes against the model's patch geometry."""
    unit = m.vision.patch_size * m.vision.spatial_merge_size
    _require(unit**2 <= d.max_pixels, f"data.max_pixels ({d.max_pixels}) must be >= (patch_size*merge)^2 = {unit**2}")
    _require(d.mock.min_image_side % unit == 0 and d.mock.max_image_side % unit == 0,
             f"data.mock.min_image_side/max_image_side must be multiples of patch_size*spatial_merge_size = {unit}")


def vision_warmup_patches(cfg: Config) -> int:
    """train.cuda_graphs.vision_warmup_patches with -1 resolved: every merged patch is one token of
    the row, so no micro-batch holds more than micro_batch_size x seq_length x merge^2 patches."""
    t = cfg.train
    if t.cuda_graphs.vision_warmup_patches >= 0:
        return t.cuda_graphs.vision_warmup_patches
    return t.micro_batch_size * t.seq_length * cfg.model.vision.spatial_merge_size**2


def validate_eval(t: TrainConfig, d: DataConfig) -> None:
    """The validation data train.eval_interval reads (the counts are TrainConfig.validate's)."""
    if not t.eval_interval:
        return
    if d.name == "conversations":
        _require(conversations_path(d.valid_path),
                 f"train.eval_interval={t.eval_interval} with data.name=conversations needs data.valid_path: an "
                 f"existing .json or .jsonl file or datasets folder of held-out conversations, got {d.valid_path!r} "
                 "(or set train.eval_interval=0)")
    if d.name == "cord_v2":
        _require(bool(d.valid_split), "data.valid_split must name the cord_v2 split to validate on (e.g. validation)")


MODEL_INITS = ("layout_independent", "megatron")  # model.init (models/common/layout_init.py)


def validate_layout(m: ModelConfig, p: ParallelConfig) -> None:
    """The model's shapes against the parallel layout: the attention heads every family has here,
    then the family's own rules (``ModelFamily.validate``: its mixers, experts, kernels)."""
    # checked here, not at the first forward, so that a misspelling surfaces before the build
    _require(m.attention_backend in ATTENTION_BACKENDS,
             f"model.attention_backend must be one of {'|'.join(ATTENTION_BACKENDS)}, got {m.attention_backend!r}")
    _require(m.num_attention_heads % m.num_query_groups == 0,
             f"model.num_attention_heads ({m.num_attention_heads}) must be a multiple of "
             f"model.num_query_groups ({m.num_query_groups})")
    _require(m.num_attention_heads % p.tp == 0,
             f"model.num_attention_heads ({m.num_attention_heads}) must be divisible by parallel.tp ({p.tp})")
    _require(m.num_query_groups % p.tp == 0 or p.tp % m.num_query_groups == 0,
             f"model.num_query_groups ({m.num_query_groups}) and parallel.tp ({p.tp}) must divide one another")
    _require(m.num_attention_heads % (p.tp * p.cp) == 0,
             f"model.num_attention_heads ({m.num_attention_heads}) must be divisible by parallel.tp*cp "
             f"({p.tp * p.cp}): context parallelism gives each rank heads/(tp*cp) heads of the whole sequence")
    if not m.num_experts:
        _require(p.ep == 1, "parallel.ep > 1 needs an MoE model (model.num_experts > 0)")
    _require(getattr(m, "init", "layout_independent") in MODEL_INITS,
             f"model.init must be one of {'|'.join(MODEL_INITS)}, got {getattr(m, 'init', None)!r}")
    get_model_family(m.name).validate(m, p)


def validate_moe_a2a_overlap(cfg: Config) -> None:
    """``parallel.moe_a2a_overlap``: megatron-core asserts these in TransformerConfig.__post_init__
    (or fails later, deep in the schedule); here each one names our field and the fix."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    why = "parallel.moe_a2a_overlap=true"
    _require(bool(m.num_experts),
             f"{why} needs an MoE model (model.num_experts > 0); set parallel.moe_a2a_overlap=false")
    _require(p.ep > 1, f"{why} hides the expert-parallel all-to-all, which exists only with parallel.ep > 1 "
                       f"(got {p.ep}); set parallel.ep >= 2 or parallel.moe_a2a_overlap=false")
    dispatcher = getattr(m, "moe_token_dispatcher", None)  # a family's MoE field, where it has one
    _require(dispatcher == "alltoall", f"{why} needs model.moe_token_dispatcher=alltoall (got {dispatcher!r})")
    # 'auto' is bf16 on a GPU; the model builder refuses it where it resolves to fp32 (no GPU)
    _require(t.precision != "fp32", f"{why} needs bf16 (megatron supports the overlap for bf16/fp16 models "
                                    "only); set train.precision=bf16 (or auto on a GPU)")
    _require(p.pp == 1, f"{why} runs megatron's combined 1F1B schedule, which this trainer does not run "
                        f"under pipeline parallelism (plain or interleaved); set parallel.pp=1 (got {p.pp})")
    # megatron's own recompute options (full / method / num_layers / 'moe') are not exposed by our
    # recipe; of ours, the layernorm discard-output hook replays the pre-MLP norm from a hook on
    # MoELayer.forward, which the split schedule never calls (it calls route/dispatch/... itself)
    _require("layernorm" not in t.recompute_modules,
             f"{why} cannot be combined with train.recompute_modules 'layernorm' (the pre-MLP norm "
             "recompute hooks MoELayer.forward, which the overlapped schedule bypasses); drop 'layernorm'")


def resolve_sources(cfg: Config) -> Config:
    """Fill what the recipe delegates to files: the architecture from ``model.hf_config`` and the
    special token ids from ``data.tokenizer`` (never guessed). Idempotent; call before validate.
    ``checkpoint.load`` naming a Hugging Face folder is also the architecture, unless
    ``model.hf_config`` names one."""
    from multimodal.hf_convert import is_hf_folder

    if cfg.checkpoint.load and not cfg.model.hf_config and is_hf_folder(cfg.checkpoint.load):
        cfg.model.hf_config = cfg.checkpoint.load
    if cfg.model.hf_config:
        family = get_model_family(cfg.model.name)
        _require(family.hf_adapter is not None, f"model.hf_config: model.name={cfg.model.name} has no Hugging "
                 "Face config reader; set model.hf_config=null and give the architecture in the recipe")
        mtp_unset = hasattr(cfg.model, "mtp_num_layers") and "model.mtp_num_layers" not in getattr(cfg, "given", ())
        if mtp_unset:  # None: model_config_from_hf reads the checkpoint's depth (the released ones have
            cfg.model.mtp_num_layers = None  # one head), so a fine-tune keeps training it
        cfg.model = get_hf_adapter(family).model_config_from_hf(cfg.model.hf_config, base=cfg.model)
    if cfg.data.tokenizer:
        from data.chat import special_token_ids
        from data.registry import load_tokenizer

        for key, value in special_token_ids(load_tokenizer(cfg.data)).items():
            setattr(cfg.model, key, value)
        _fill_from_processor_files(cfg)
    return cfg


def _fill_from_processor_files(cfg: Config) -> None:
    """The data keys the checkpoint's processor files (beside data.tokenizer) give, as the model
    family reads them, for each key the recipe left at its default: a value set in the recipe wins."""
    found = get_model_family(cfg.model.name).processor_settings(cfg.data.tokenizer, cfg.model.vision)
    defaults = DataConfig()
    for dotted, value in found.items():
        *path, leaf = dotted.split(".")
        section, default = cfg.data, defaults
        for part in path:
            section, default = getattr(section, part), getattr(default, part)
        if getattr(section, leaf) == getattr(default, leaf):
            setattr(section, leaf, value)


def config_to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
