"""What an architecture provides to the trainer: one ``ModelFamily`` per entry of ``models.MODEL_REGISTRY``.

The trainer (``multimodal/``) reaches an architecture only through these fields, so the knowledge
of its layers (layer kinds, widths, module classes) stays in its folder ``models/<name>/``.
Importing this module, the registry (``models``) or a family's config, validate and count
modules loads no torch or megatron (tests/test_model_family.py checks it in a fresh process):
the dry run and the FLOP count read them on a machine without GPUs, in well under a second.
What needs torch is imported when called.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class StageParams:
    """Parameters one rank of pipeline stage ``stage`` holds (``ModelFamily.stage_params``)."""

    stage: int
    layers: dict[str, int]  # decoder layer kind -> its layers on this stage (keys of activation_bytes_per_token)
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


class GraphRowBuffers:
    """What a family's layers read of a packed row beyond its boundaries, held for the decoder CUDA
    graphs (models/performance/layer_graphs.StaticBatch). A graph replays fixed addresses and
    shapes, so each such piece of ``PackedRowParams`` is a static buffer refilled on the device
    from every micro-batch. This base class is a family whose layers need nothing more."""

    def __init__(self, fields: dict | None = None):
        self.fields = fields or {}  # PackedRowParams field -> the static value the graphed layers read

    def refusal(self, params) -> str | None:
        """None if a micro-batch's ``PackedRowParams`` fits these buffers, else why not (counted
        as an eager micro-batch under that reason)."""
        return None

    def load(self, params) -> None:
        """Copy a micro-batch's values into the buffers (on the device, no host sync); the static
        boundaries already hold its segments."""

    def capturing(self) -> contextlib.AbstractContextManager:
        """A context the warm-up and capture run in (e.g. a kernel library's caches turned off)."""
        return contextlib.nullcontext()


class MixerCheckpoints:
    """What ``ModelFamily.mixer_checkpoints`` installs its blocks through (one per decoder layer,
    multimodal/performance/recompute.py): ``checkpoint(fn, *args)`` runs ``fn(*args)`` as a
    discard-output block of the layer's mixer half (its outputs are freed once the mixer has
    returned and regenerated before backward reads them) and returns its outputs; ``active()``
    says whether blocks are being discarded now (training with grad)."""

    def checkpoint(self, fn: Callable, *args):
        raise NotImplementedError

    def active(self) -> bool:
        raise NotImplementedError


@dataclass(frozen=True)
class ModelFamily:
    """One architecture, as the trainer sees it. ``m`` below is the recipe's ``model`` section, an
    instance of ``config_class``; ``p`` its ``parallel`` section.

    - ``config_class``: the dataclass the YAML ``model:`` section is read into (the family named by
      ``model.name``); it extends ``models.common.model_config.ModelConfig`` with the family's own
      fields and a ``vision`` section with the patch geometry the data pipeline reads.
    - ``validate(m, p)``: the family's recipe rules (its shapes against the layout, its kernel
      choices); raises ``core.errors.ConfigError`` with one line naming the field and the fix.
      The trainer checks the common fields itself (attention heads against tp/cp, vocab, layers).
    - ``position_ids(input_ids, image_grid_thw, image_token_id, spatial_merge_size)`` -> the
      position ids [3, L] of one sample, built by the data pipeline (a 1-D rotary model repeats
      its positions on the three rows).
    - ``video_position_grids(video_grid_thw)`` -> the grids whose runs of video tokens
      ``position_ids`` places, one video's (t, h, w) at a time (Qwen3-VL: t grids of (1, h, w), one
      per temporal group, each run between timestamp text); the default keeps the grid whole.
    - ``vision_graph_buckets(max_patches, unit)`` -> the sizes of the vision encoder's CUDA graph
      buckets for that many patches (``train.cuda_graphs.vision_warmup_patches``); None when the
      encoder has no graphs.

    - ``build(model_cfg, parallel_cfg, params_dtype, pre_process=True, post_process=True,
      deterministic=False)`` -> ``models.base.MultimodalModel`` (this pipeline stage's part).
    - ``training_flops(m, sample_lengths, image_grids, lm_head_tokens=None, mtp_head_tokens=None)``
      -> forward + backward FLOPs of the real samples of a batch: their lengths, the (t, h, w)
      patch grid of each image, and the tokens the LM head ran on (None: every real token), for
      the LM and for the MTP depths together. Feeds tflops_per_gpu and MFU.
    - ``stage_params(m, tp=1, pp=1, ep=1, stage=0)`` -> ``StageParams``: the exact parameter count
      of one rank of a pipeline stage (tests/test_dry_run.py compares it with the built model);
      a ``parts["vision"]`` entry, when present, is reported as the vision share.
    - ``model_params(m)`` -> (total, active per token) parameters of the whole model.
    - ``activation_bytes_per_token(m, layout)`` -> {layer kind: bytes of saved activations per
      token of one decoder layer of that kind}; ``layout`` has ``tp`` and ``sequence_parallel``.
    - ``vision_bytes_per_patch(m)`` -> bytes of saved activations per image patch in the encoder.
    - ``recompute_modules``: the ``train.recompute_modules`` entries its layers have (others are
      refused at start-up), in the order a memory sweep tries them alone; the default is what
      every attention layer has. ``recompute_modules_no_cp``: those of its own entries that do not
      work with context parallelism (refused with ``parallel.cp > 1``).
    - ``mixer_checkpoints(mixer, modules, blocks)`` -> how many blocks of ``mixer`` (a decoder
      layer's ``self_attention``) it set to be recomputed for the ``train.recompute_modules``
      entries ``modules``, each installed through ``blocks`` (a ``MixerCheckpoints``); 0 for a
      mixer that is not one of its own (every registered family is asked). The trainer handles
      the entries of megatron's modules itself (``core_attn``, ``layernorm``, ``shared_experts``,
      ``moe_act``). Called only when recompute is installed (it may import torch).
    - ``graph_row_buffers(layers, cu_seqlens, seq, max_samples, one_segment)`` -> the
      ``GraphRowBuffers`` its mixers among ``layers`` (a decoder's layers) need under the decoder
      CUDA graphs, None when none of them is its own (every registered family is asked).
      ``cu_seqlens``: the graphs' static int64 boundaries, ``max_samples + 2`` entries filled
      before ``load``; segment ``max_samples`` is always empty (a target for padding). ``seq``:
      the row length; ``one_segment``: the buffers serve one-sample rows (exact max_seqlen).
    - ``packed_row_extras(cu_seqlens, device)`` -> {``models.common.packed_seq.PackedRowParams``
      field: value} built once per packed micro-batch from its host cu_seqlens (the padded ones
      when given) and handed to every layer (Qwen3.5: the GDN layers' chunk table,
      ``mixer_varlen``); the default builds nothing.
    - ``prepare_host_batch(batch, m)``: host work on a loaded micro-batch that the prefetch thread
      does while the GPU runs earlier steps, so the training thread finds it done (Qwen3.5: the
      vision geometry of each image size, cached; on the training thread it leaves the GPU idle
      for part of a varied-image step, docs/performance.md). None: nothing to do.

    - ``hf_adapter()`` -> the family's Hugging Face adapter (None: the family has none, and
      scripts/convert_hf.py, hf_parity.py and bench_train.py's transformers half refuse it). It is
      loaded when called (it imports torch) and has:
      ``model_config_from_hf(path, base=None)`` (``config_class`` from a config.json, the
      non-architecture fields taken from ``base``; also what ``model.hf_config`` reads),
      ``hf_config_from_ours(m)`` (config.json content),
      ``load_hf_state_dict(hf_dir)``, ``hf_to_ours(state, m)`` / ``ours_to_hf(state, m)`` (full,
      unsharded state dicts), ``lora_to_hf(state, m)`` -> {HF module: (lora_A, lora_B)},
      ``load_full_state_dict(model, state)``, ``run_parity(hf_dir, dtype, seed)`` -> the parity
      report (with ``ok``), ``use_hf_torch_kernels()`` and ``HF_MODELING_MODULES`` (the
      transformers modules of its architectures).
    - ``hf_model_types``: the config.json ``model_type`` values ``hf_adapter`` reads (convert_hf
      import picks the family by them).
    - ``processor_settings(folder, vision)`` -> {dotted ``data`` key: value} that the processor
      files of a checkpoint folder (``data.tokenizer``) give: normalisation, pixel ranges, video
      sampling; the trainer fills the keys a recipe left at their defaults. Raises ConfigError
      where the files contradict ``vision`` (``m.vision``). The default reads nothing.
    """

    name: str
    config_class: type
    build: Callable
    training_flops: Callable[..., float]
    stage_params: Callable[..., StageParams]
    model_params: Callable[..., tuple[int, int]]
    activation_bytes_per_token: Callable[..., dict[str, float]]
    vision_bytes_per_patch: Callable[..., float]
    position_ids: Callable
    validate: Callable[..., None] = lambda m, p: None
    video_position_grids: Callable = lambda grid: grid.reshape(-1, 3)
    vision_graph_buckets: Callable[[int, int], list[int]] | None = None
    recompute_modules: tuple[str, ...] = ("core_attn", "layernorm")
    recompute_modules_no_cp: tuple[str, ...] = ()
    mixer_checkpoints: Callable[..., int] = lambda mixer, modules, blocks: 0
    graph_row_buffers: Callable[..., GraphRowBuffers | None] = (
        lambda layers, cu_seqlens, seq, max_samples, one_segment: None)
    packed_row_extras: Callable[..., dict] = lambda cu_seqlens, device: {}
    prepare_host_batch: Callable[..., None] | None = None
    hf_adapter: Callable[[], object] | None = None
    hf_model_types: tuple[str, ...] = ()
    processor_settings: Callable[..., dict] = lambda folder, vision: {}
