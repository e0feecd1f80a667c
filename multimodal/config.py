"""Typed training recipe: dataclass sections, YAML loading, dotted overrides, validation.

    cfg = load_config("configs/qwen35_vl_proxy.yaml", ["train.iters=50", "model.vision.depth=1"])

A recipe may name a base recipe (``base: base/qwen35_vl.yaml``, relative to its folder; bases may
have bases) whose sections it overrides key by key; the command-line overrides come last.
Unknown keys and badly typed values raise ``ConfigError`` naming the dotted field;
``validate(cfg, world_size)`` checks the cross-field rules at start-up.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from core.errors import ConfigError  # noqa: F401 - re-exported: callers import it from here
from data.energon_config import EnergonConfig
from data.registry import check_dataset_name
# the model and parallel sections live below the trainer, beside the model builder that reads them;
# the model section's class is the one of the family model.name names (models.MODEL_REGISTRY)
from models import DEFAULT_MODEL, get_hf_adapter, get_model_family
from models.common.attention import BACKENDS as ATTENTION_BACKENDS
from models.common.model_config import ModelConfig
from models.common.parallel_config import ParallelConfig


@dataclass
class DataConfig:
    name: str = "mock"
    path: str | None = None
    seed: int = 1234
    pack: bool = True  # THD packing; false pads each sample to train.seq_length (BSHD)
    num_samples: int = 100_000
    min_images: int = 1
    max_images: int = 3
    min_image_side: int = 32  # pixels; multiples of patch_size * spatial_merge_size
    max_image_side: int = 96
    min_text_tokens: int = 16
    max_text_tokens: int = 96
    num_classes: int = 16  # mock: image classes, each with its own answer
    # cord_v2 (and any tokenised data set)
    tokenizer: str | None = None  # tokenizer dir; the model's special token ids are read from it
    split: str = "train"
    prompt: str | None = None  # user prompt beside the image; None: the data set's default
    target_format: str = "json"  # json (gt_parse as JSON, key order kept) | donut (tags)
    # dynamic resolution: each image is resized into this pixel-area range. Defaults: the released
    # checkpoints' (Qwen3.5 preprocessor_config.json); a preprocessor_config.json beside
    # data.tokenizer replaces a range left at these defaults, a value set in the recipe wins
    min_pixels: int = 65_536
    max_pixels: int = 16_777_216
    # video parts of conversations (data/video.py). Defaults: the released checkpoints'
    # video_preprocessor_config.json. A file is sampled at video_fps frames a second (a list of
    # frames is taken as given at that rate), keeping video_min_frames..video_max_frames frames;
    # all frames of a video are resized to one size with frames*height*width in
    # [video_min_pixels, video_max_pixels] (the pixel budget of one video)
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 768
    video_min_pixels: int = 4096
    video_max_pixels: int = 25_165_824
    # per-channel normalisation; read from preprocessor_config.json beside data.tokenizer when present
    image_mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    image_std: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    max_bad_fraction: float = 0.1  # stop when more of the rows read than this are unusable
    # conversations: image paths are relative to this folder (None: the data file's or datasets folder);
    # system_prompt is put first in records without a system message
    image_root: str | None = None
    system_prompt: str | None = None
    # micro-batches built ahead in a background thread; None: 2 on GPU, 0 on CPU (where the thread
    # competes with the model for the cores, docs/data.md)
    prefetch: int | None = None
    # processes that decode/tokenise samples ahead of the trainer (0: in the training process);
    # None: up to 4 per rank on a GPU, 0 on a CPU (data.loader.default_num_workers)
    num_workers: int | None = None
    # packing: rows are filled best-fit from the next this-many samples (the oldest always first,
    # so none waits more than this many rows); 0 packs strictly in order. The 2B recipe's mock
    # rows: 89.0% real tokens in order, 98.7% with 16 (scripts/bench_loader.py's pack_fill)
    pack_lookahead: int = 16
    # pad every packed sample to a multiple of this (null: what the layout needs: 2*cp, times tp
    # under sequence parallelism); set it to compare runs of different layouts on identical rows
    pad_multiple: int | None = None
    # validation data (read when train.eval_interval > 0; multimodal/evaluation.py), the same kind
    # of data set as `name`: conversations: valid_path is a held-out .json/.jsonl file or datasets folder (required);
    # cord_v2: the valid_split split of valid_path (null: data.path); mock: the generator with seed
    # data.seed + 1 (valid_path must stay null)
    valid_path: str | None = None
    valid_split: str = "validation"
    energon: EnergonConfig = field(default_factory=EnergonConfig)  # data.name=energon (data/energon.py)


@dataclass
class TrainConfig:
    iters: int = 30
    micro_batch_size: int = 1
    global_batch_size: int = 4
    seq_length: int = 512
    seed: int = 1234
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    # megatron-core's deterministic_mode plus torch's deterministic kernels where they exist (the
    # MoE combine, scatter/index ops); slower. Kernels without such a version (flash attention's
    # and fla's backward) still vary in the last bits from run to run.
    deterministic: bool = False
    # selective activation recompute (multimodal/performance/recompute.py): core_attn, layernorm,
    # shared_experts, moe_act, gdn_qkv, gdn_norm_out; outputs and gradients unchanged bit for bit
    recompute_modules: list[str] = field(default_factory=list)
    # Decoder layers replayed as CUDA graphs, forward and backward (models/performance/layer_graphs.py):
    # removes most of the host's kernel-launch time. GPU, packed rows, pp=tp=cp=1, no recompute.
    # MoE decoder layers stay eager (only the vision encoder's graphs run; recompute allowed).
    # Rows with more samples than cuda_graph_max_samples run eagerly (counted).
    cuda_graphs: bool = False
    cuda_graph_max_samples: int = 64  # per packed row (decoder) and images per micro-batch (vision)
    # The vision encoder too (where its family has graphs: models/qwen35_vl/vision_graphs.py): its
    # input padded up to a bucket of patches (multiples of this many up to 8 of them, then 8 sizes
    # per doubling: at most 1/8 padding), one graph pair per bucket, at most
    # cuda_graph_vision_max_buckets of them (further sizes run eagerly, counted). 0 = eager.
    cuda_graph_vision_bucket: int = 1024
    cuda_graph_vision_max_buckets: int = 24
    # Capture every vision bucket up to this many patches at the first micro-batch, so no later
    # step stops to capture one (e.g. the largest row of images the data can make; 0 = capture
    # each bucket when first seen; -1 = the most a micro-batch can hold, micro_batch_size x
    # seq_length x spatial_merge_size^2, as each merged patch is a token of the row).
    # At most cuda_graph_vision_max_buckets buckets.
    cuda_graph_vision_warmup_patches: int = 0
    # The backward graphs add the parameter gradients into DDP's main_grad themselves (megatron's
    # grad_added_to_main_grad convention), instead of returning static gradients that autograd
    # copies and DDP's hook then adds in one launch per parameter. false: the latter.
    cuda_graph_grads_to_main_grad: bool = True
    # A step whose gradient norm is not finite (NaN/inf loss or gradients) never updates the
    # weights: the optimizer's kernels skip it on the device, no host sync (multimodal/nonfinite.py).
    # skip: count it and go on, stop after max_nonfinite_steps in a row; stop: stop at the first.
    # Either is noticed at the next log step (logging.interval) or checkpoint.
    on_nonfinite: str = "skip"
    max_nonfinite_steps: int = 10
    # validation loss (multimodal/evaluation.py) every eval_interval steps and after the last step
    # (0 = off), over eval_iters global batches (train.global_batch_size rows each) of the
    # validation data (data.valid_path), the same batches at every evaluation; each sample at most
    # once (rows past the set's end are blank, never repeats)
    eval_interval: int = 0
    eval_iters: int = 10


@dataclass
class OptimizerConfig:
    name: str = "adam"
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_iters: int = 3
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


@dataclass
class CheckpointConfig:
    dir: str | None = None
    interval: int = 0  # 0: only at the end
    load: str | None = None  # a checkpoint dir, or "latest" to resume from checkpoint.dir
    save_at_end: bool = True
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


@dataclass
class LoggingConfig:
    dir: str = "runs/default"
    interval: int = 1
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "qwen35-vl"
    # offline | online | disabled; null: the WANDB_MODE environment variable, else offline
    wandb_mode: str | None = None
    progress_bar: bool = True
    peak_tflops: float | None = None  # per device; default from the device name (H100/H200: 989)
    # CUDA allocator history from start-up, dumped to <dir>/memory_snapshot.pickle after step
    # memory_snapshot_step (pytorch.org/memory_viz); multimodal/observability/memory.py. No-op on CPU.
    memory_history: bool = False
    memory_snapshot_step: int = 3
    # 0: Python's automatic GC; N: GC off, gc.collect() every N steps on every rank at once
    manual_gc_interval: int = 0
    # torch.profiler over steps profile_step .. profile_step + profile_num_steps - 1 (0 = off) on
    # profile_ranks: <dir>/profile/trace_rank{r}.json.gz + kernels_rank{r}.txt (multimodal/observability/profiling.py)
    profile_step: int = 0
    profile_num_steps: int = 2
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    # record Python frames too: the summary's longest idle gaps then show which code launched the
    # kernel the GPU waited for (costs more host time in the profiled steps)
    profile_with_stack: bool = False


@dataclass
class Config:
    model: ModelConfig = field(default_factory=lambda: get_model_family(DEFAULT_MODEL).config_class())
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
    raw = _read_recipe(Path(path)) if path is not None else {}
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        _set_dotted(raw, key.strip(), _parse_yaml(value, f"override {item!r}") if value.strip() else None)
    return _build(Config, raw, "")


def _read_recipe(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe's sections with its ``base:`` chain merged underneath: ``base`` names another recipe,
    relative to this one's folder, whose values this one's replace key by key (nested sections too)."""
    if not path.is_file():
        named_by = f" (the base named by {chain[-1]})" if chain else ""
        raise ConfigError(f"config file {path}{named_by} does not exist")
    here = path.resolve()
    if here in chain:
        loop = " -> ".join(str(p) for p in (*chain, here))
        raise ConfigError(f"recipe bases form a cycle: {loop}; remove one of these base: keys")
    raw = _parse_yaml(path.read_text(), str(path)) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base must be the path of a recipe relative to {path.parent}, got {base!r}")
    return _merge(_read_recipe(here.parent / base, (*chain, here)), raw)


def _merge(under: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over``'s values replace ``under``'s; a mapping on both sides is merged the same way, so a recipe
    sets one field of its base's section without repeating the others. Lists are values, not merged."""
    merged = dict(under)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = _merge(merged[key], value)
        merged[key] = value
    return merged


def _parse_yaml(text: str, where: str):
    """PyYAML, with its error as ``where:line:column: problem`` (its own message spans many lines
    and names the stream ``<unicode string>``)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        problem = getattr(e, "problem", None) or getattr(e, "context", None) or str(e)
        at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None else where
        raise ConfigError(f"{at}: invalid YAML: {' '.join(str(problem).split())}") from None


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
    node[parts[-1]] = value


def _build(cls: type, raw: Any, where: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        bad = ", ".join(f"{where}{k}" for k in unknown)
        raise ConfigError(f"unknown config key(s): {bad}; valid keys here: {sorted(names)}")
    kwargs = {}
    for name, value in raw.items():
        tp = _model_section_class(value) if cls is Config and name == "model" else hints[name]
        kwargs[name] = _coerce(tp, value, f"{where}{name}")
    return cls(**kwargs)


def _model_section_class(raw: Any) -> type:
    """The dataclass of the family that the ``model`` section's ``name`` names (default: DEFAULT_MODEL)."""
    name = raw.get("name", DEFAULT_MODEL) if isinstance(raw, dict) else DEFAULT_MODEL
    try:
        return get_model_family(name).config_class
    except KeyError as e:
        raise ConfigError(e.args[0]) from None


def _coerce(tp: Any, value: Any, where: str):
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where + ".")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, where)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    return value


# ---------------------------------------------------------------- validation


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _conversations_path(path: str | None) -> bool:
    """A .json / .jsonl file or a folder (datasets' arrow / parquet, or JSON files): data/record_sources.py."""
    return bool(path) and (Path(path).is_dir() or (Path(path).suffix in (".json", ".jsonl") and Path(path).is_file()))


def validate(cfg: Config, world_size: int = 1) -> None:
    """Cross-field checks that need no model; raises ConfigError naming the field and fix."""
    m, t, p, d, o = cfg.model, cfg.train, cfg.parallel, cfg.data, cfg.optimizer
    for name, value in [
        ("train.iters", t.iters), ("train.micro_batch_size", t.micro_batch_size),
        ("train.global_batch_size", t.global_batch_size), ("train.seq_length", t.seq_length),
        ("parallel.tp", p.tp), ("parallel.pp", p.pp), ("parallel.cp", p.cp), ("parallel.ep", p.ep),
        ("logging.interval", cfg.logging.interval), ("model.num_layers", m.num_layers),
        ("model.hidden_size", m.hidden_size),
        ("optimizer.overlap_step_pieces", o.overlap_step_pieces),
    ]:
        _require(value >= 1, f"{name} must be >= 1, got {value}")
    _require(cfg.checkpoint.interval >= 0, "checkpoint.interval must be >= 0 (0 = only at the end)")
    if t.cuda_graphs:
        from models.performance.layer_graphs import refusal

        why = refusal(cfg)
        _require(why is None, f"train.cuda_graphs: {why}")
        _require(t.cuda_graph_max_samples >= 1, "train.cuda_graph_max_samples must be >= 1")
        merge2 = m.vision.spatial_merge_size**2
        _require(t.cuda_graph_vision_bucket >= 0 and t.cuda_graph_vision_bucket % merge2 == 0,
                 f"train.cuda_graph_vision_bucket must be 0 (vision eager) or a positive multiple of "
                 f"model.vision.spatial_merge_size^2 = {merge2}, got {t.cuda_graph_vision_bucket}")
        _require(t.cuda_graph_vision_max_buckets >= 1, "train.cuda_graph_vision_max_buckets must be >= 1")
        _require(t.cuda_graph_vision_warmup_patches >= -1,
                 "train.cuda_graph_vision_warmup_patches must be >= 0, or -1 for the most a micro-batch can hold")
        buckets = get_model_family(m.name).vision_graph_buckets
        warmup = vision_warmup_patches(cfg)
        if warmup and t.cuda_graph_vision_bucket and buckets is not None:
            n = len(buckets(warmup, t.cuda_graph_vision_bucket))
            _require(n <= t.cuda_graph_vision_max_buckets,
                     f"train.cuda_graph_vision_warmup_patches={t.cuda_graph_vision_warmup_patches} needs {n} vision "
                     f"buckets (up to {warmup} patches), more than train.cuda_graph_vision_max_buckets="
                     f"{t.cuda_graph_vision_max_buckets}; raise that or lower the warm-up")
    if m.freeze:
        from multimodal.freeze import check_freeze

        why = check_freeze(m.freeze, m.tie_word_embeddings)
        _require(why is None, f"model.freeze: {why}")
    if m.lora.rank:
        from multimodal.lora import check_lora

        why = check_lora(m.lora)
        _require(why is None, f"model.lora.{why}")
    if t.recompute_modules:
        from multimodal.performance.recompute import check_modules

        why = check_modules(t.recompute_modules, p.cp)
        _require(why is None, f"train.recompute_modules: {why}")
        has = get_model_family(m.name).recompute_modules
        lacking = [name for name in t.recompute_modules if name not in has]
        _require(not lacking, f"train.recompute_modules: model.name={m.name} has no {lacking}; choose from {list(has)}")
    _require(cfg.logging.memory_snapshot_step >= 1,
             f"logging.memory_snapshot_step must be >= 1 (the step after which the snapshot is written), "
             f"got {cfg.logging.memory_snapshot_step}")
    _require(cfg.logging.manual_gc_interval >= 0,
             f"logging.manual_gc_interval must be >= 0 (0 keeps Python's automatic GC), "
             f"got {cfg.logging.manual_gc_interval}")
    _require(cfg.logging.profile_step >= 0 and cfg.logging.profile_num_steps >= 1,
             f"logging.profile_step must be >= 0 (0 = off) and logging.profile_num_steps >= 1, got "
             f"{cfg.logging.profile_step} and {cfg.logging.profile_num_steps}")
    _require(t.precision in ("auto", "bf16", "fp32"), f"train.precision must be auto|bf16|fp32, got {t.precision!r}")
    check_dataset_name(d.name)
    if d.name == "conversations":
        _require(_conversations_path(d.path),
                 f"data.name=conversations needs data.path: an existing .json or .jsonl file or datasets folder, "
                 f"got {d.path!r}")
        _require(bool(d.tokenizer), "data.name=conversations needs data.tokenizer (a tokenizer directory)")
        _require(d.image_root is None or Path(d.image_root).is_dir(),
                 f"data.image_root={d.image_root!r} is not a folder (null: the data file's folder)")
    if d.name == "cord_v2":
        _require(bool(d.path), "data.name=cord_v2 needs data.path (the CORD-v2 folder of parquet files)")
        _require(Path(d.path).exists(), f"data.path={d.path!r} does not exist (data.name=cord_v2 reads a folder of "
                 "parquet files, e.g. scripts/make_synthetic_cord.py's output); point data.path at it")
        _require(bool(d.tokenizer), "data.name=cord_v2 needs data.tokenizer (a tokenizer directory)")
    validate_eval(t, d)
    _require(d.target_format in ("json", "donut"), f"data.target_format must be json|donut, got {d.target_format!r}")
    _require(0.0 <= d.max_bad_fraction <= 1.0, "data.max_bad_fraction must be in [0, 1]")
    unit = m.vision.patch_size * m.vision.spatial_merge_size
    _require(unit**2 <= d.max_pixels and 1 <= d.min_pixels <= d.max_pixels,
             f"data.min_pixels ({d.min_pixels}) and data.max_pixels ({d.max_pixels}) need "
             f"1 <= min_pixels <= max_pixels and max_pixels >= (patch_size*merge)^2 = {unit**2}")
    _require(d.prefetch is None or d.prefetch >= 0,
             "data.prefetch must be >= 0 (0 disables the background loader thread) or null (auto)")
    _require(d.video_fps > 0 and 1 <= d.video_min_frames <= d.video_max_frames,
             f"data.video_fps ({d.video_fps}) must be > 0 and 1 <= data.video_min_frames ({d.video_min_frames}) "
             f"<= data.video_max_frames ({d.video_max_frames})")
    _require(1 <= d.video_min_pixels <= d.video_max_pixels,
             f"data.video_min_pixels ({d.video_min_pixels}) must be in [1, data.video_max_pixels ({d.video_max_pixels})]")
    _require(len(d.image_mean) == 3 and len(d.image_std) == 3 and all(x > 0 for x in d.image_std),
             "data.image_mean and data.image_std need 3 values (RGB), std > 0")
    _require(d.pad_multiple is None or d.pad_multiple >= 1, "data.pad_multiple must be >= 1 or null (auto)")
    _require(d.num_workers is None or d.num_workers >= 0,
             "data.num_workers must be >= 0 (0 reads samples in the training process) or null (auto)")
    _require(d.pack_lookahead >= 0, "data.pack_lookahead must be >= 0 (0 packs samples strictly in order)")
    _require(o.lr_decay_style in ("cosine", "linear", "constant"),
             f"optimizer.lr_decay_style must be cosine|linear|constant, got {o.lr_decay_style!r}")
    # each bound on its own first: a negative lr is reported as such, not as a min_lr problem
    # lr = 0 is allowed: a run that must leave the weights as they are (checking a conversion)
    _require(o.lr >= 0, f"optimizer.lr must be >= 0, got {o.lr}")
    _require(o.min_lr >= 0, f"optimizer.min_lr must be >= 0, got {o.min_lr}")
    _require(o.min_lr <= o.lr, f"optimizer.min_lr ({o.min_lr}) must be <= optimizer.lr ({o.lr})")
    _require(t.on_nonfinite in ("skip", "stop"), f"train.on_nonfinite must be skip|stop, got {t.on_nonfinite!r}")
    _require(t.max_nonfinite_steps >= 1, f"train.max_nonfinite_steps must be >= 1, got {t.max_nonfinite_steps}")
    _require(cfg.logging.wandb_mode in (None, "offline", "online", "disabled"),
             f"logging.wandb_mode must be offline|online|disabled or null, got {cfg.logging.wandb_mode!r}")
    _require(not (o.overlap_step and o.flat is False),
             "optimizer.overlap_step=true runs flat AdamW's kernel on a second stream: set optimizer.flat to "
             "true or null, or optimizer.overlap_step to false or null")
    _require(not (o.overlap_step and p.use_distributed_optimizer),
             "optimizer.overlap_step=true: the distributed optimizer all-gathers the parameters right after "
             "its step, so the step cannot run behind the next forward; set optimizer.overlap_step=null or false")
    _require(cfg.checkpoint.load != "latest" or cfg.checkpoint.dir is not None,
             "checkpoint.load=latest needs checkpoint.dir")
    if cfg.checkpoint.save_hf:
        _require(cfg.checkpoint.dir is not None and cfg.checkpoint.save_at_end,
                 "checkpoint.save_hf writes the final checkpoint: it needs checkpoint.dir and checkpoint.save_at_end=true")
        _require(get_model_family(cfg.model.name).hf_adapter is not None,
                 f"checkpoint.save_hf: model.name={cfg.model.name} has no Hugging Face adapter; unset checkpoint.save_hf")

    model_parallel = p.tp * p.pp * p.cp
    _require(world_size % model_parallel == 0,
             f"world size {world_size} is not divisible by parallel.tp*pp*cp = {model_parallel}; "
             "change the parallel layout or the number of processes")
    dp = world_size // model_parallel
    _require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
             f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
             f"train.micro_batch_size ({t.micro_batch_size}) x data-parallel size ({dp})")
    if d.pack:
        _require(t.micro_batch_size == 1,
                 "data.pack=true builds one packed row of train.seq_length tokens per micro-batch; "
                 "set train.micro_batch_size=1 (raise train.seq_length for more tokens per micro-batch)")
    if p.cp > 1:
        # every sample is cut into 2*cp chunks (load-balanced zigzag); the row must split too
        multiple = 2 * p.cp * (p.tp if p.sequence_parallel and p.tp > 1 else 1)
        _require(t.seq_length % multiple == 0,
                 f"train.seq_length ({t.seq_length}) must be a multiple of 2*cp{'*tp' if multiple > 2 * p.cp else ''}"
                 f" = {multiple} under context parallelism; pick a seq_length that is")
    if p.pp > 1:
        # megatron splits the decoder evenly (get_num_layers_to_build); the vision encoder and the
        # embedding ride on the first stage, the output layer and the loss on the last.
        _require(m.num_layers % p.pp == 0,
                 f"model.num_layers ({m.num_layers}) must be divisible by parallel.pp ({p.pp}) (every "
                 "pipeline stage gets num_layers/pp decoder layers); choose a pp that divides it")

    validate_layout(m, p)
    if p.moe_a2a_overlap:
        validate_moe_a2a_overlap(cfg)
    v = m.vision
    unit = v.patch_size * v.spatial_merge_size
    _require(d.min_image_side % unit == 0 and d.max_image_side % unit == 0,
             f"data.min_image_side/max_image_side must be multiples of patch_size*spatial_merge_size = {unit}")
    _require(1 <= d.min_images <= d.max_images, "data.min_images must be in [1, data.max_images]")
    special = [m.image_token_id, m.video_token_id, m.vision_start_token_id, m.vision_end_token_id, m.im_start_token_id,
               m.im_end_token_id, m.eos_token_id, m.pad_token_id]
    _require(all(0 <= s < m.vocab_size for s in special),
             f"special token ids {special} must lie inside model.vocab_size ({m.vocab_size})")
    # a tokenizer keeps its special ids together; a video id far from the image id is the default
    # left behind in a recipe with a real vocabulary, where it is an ordinary text token
    _require(abs(m.video_token_id - m.image_token_id) < 256,
             f"model.video_token_id={m.video_token_id} is far from model.image_token_id={m.image_token_id}; set it "
             "to the tokenizer's <|video_pad|> id (Qwen3.5: 248057) or read the model from model.hf_config")


def vision_warmup_patches(cfg: Config) -> int:
    """train.cuda_graph_vision_warmup_patches with -1 resolved: every merged patch is one token of
    the row, so no micro-batch holds more than micro_batch_size x seq_length x merge^2 patches."""
    t = cfg.train
    if t.cuda_graph_vision_warmup_patches >= 0:
        return t.cuda_graph_vision_warmup_patches
    return t.micro_batch_size * t.seq_length * cfg.model.vision.spatial_merge_size**2


def validate_eval(t: TrainConfig, d: DataConfig) -> None:
    """train.eval_interval / eval_iters and the validation data they read."""
    _require(t.eval_interval >= 0, f"train.eval_interval must be >= 0 (steps between evaluations; 0 = no "
                                   f"validation), got {t.eval_interval}")
    _require(t.eval_iters >= 1, f"train.eval_iters must be >= 1 (global batches per evaluation), got {t.eval_iters}")
    _require(d.valid_path is None or d.name != "mock",
             f"data.valid_path={d.valid_path!r} is for conversations and cord_v2 data; mock validation draws "
             "its own held-out samples (seed data.seed + 1): set data.valid_path=null")
    if not t.eval_interval:
        return
    if d.name == "conversations":
        vp = d.valid_path
        _require(_conversations_path(vp),
                 f"train.eval_interval={t.eval_interval} with data.name=conversations needs data.valid_path: an "
                 f"existing .json or .jsonl file or datasets folder of held-out conversations, got {vp!r} (or set "
                 "train.eval_interval=0)")
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
    _require(p.pp == 1, f"{why} with pipeline parallelism needs virtual pipeline stages, which this trainer "
                        f"does not build; set parallel.pp=1 (got {p.pp})")
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
        cfg.model = get_hf_adapter(family).model_config_from_hf(cfg.model.hf_config, base=cfg.model)
    if cfg.data.tokenizer:
        from data.chat import special_token_ids
        from data.registry import load_tokenizer

        for key, value in special_token_ids(load_tokenizer(cfg.data)).items():
            setattr(cfg.model, key, value)
        _read_image_processor(cfg)
        _read_video_processor(cfg)
    return cfg


def _read_video_processor(cfg: Config) -> None:
    """A checkpoint's video_preprocessor_config.json (beside the tokenizer): its sampling rate, frame
    range and per-video pixel range, for the data.video_* keys the recipe left at their defaults."""
    path = Path(cfg.data.tokenizer) / "video_preprocessor_config.json"
    if not path.is_file():
        return
    import json

    pre = json.loads(path.read_text())
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    found = {"video_fps": pre.get("fps"), "video_min_frames": pre.get("min_frames"),
             "video_max_frames": pre.get("max_frames"), "video_min_pixels": size.get("shortest_edge"),
             "video_max_pixels": size.get("longest_edge")}
    defaults = DataConfig()
    for key, value in found.items():
        if value is not None and getattr(cfg.data, key) == getattr(defaults, key):
            setattr(cfg.data, key, type(getattr(defaults, key))(value))


def _read_image_processor(cfg: Config) -> None:
    """A checkpoint's preprocessor_config.json (beside the tokenizer) fixes normalisation and patching:
    take its mean/std, and refuse patch sizes that disagree with model.vision (silently wrong inputs)."""
    path = Path(cfg.data.tokenizer) / "preprocessor_config.json"
    if not path.is_file():
        return
    import json

    pre = json.loads(path.read_text())
    pre = pre.get("image_processor", pre)  # some checkpoints nest it
    v = cfg.model.vision
    for key, ours in (("patch_size", v.patch_size), ("temporal_patch_size", v.temporal_patch_size),
                      ("merge_size", v.spatial_merge_size)):
        if key in pre and int(pre[key]) != ours:
            raise ConfigError(f"{path} has {key}={pre[key]} but the model's vision config has {ours}; "
                              "point data.tokenizer at the matching checkpoint or fix model.vision")
    for key in ("image_mean", "image_std"):
        if key in pre:
            setattr(cfg.data, key, [float(x) for x in pre[key]])
    # the pixel range: Qwen3-VL/3.5 files name it size.shortest_edge/longest_edge (areas, not
    # sides), Qwen2-VL files min_pixels/max_pixels
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    defaults = DataConfig()
    for key, names in (("min_pixels", ("shortest_edge", "min_pixels")), ("max_pixels", ("longest_edge", "max_pixels"))):
        found = [size[n] for n in names if n in size] + ([pre[key]] if key in pre else [])
        if found and getattr(cfg.data, key) == getattr(defaults, key):
            setattr(cfg.data, key, int(found[0]))


def config_to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
