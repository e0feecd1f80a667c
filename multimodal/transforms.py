"""The ordered transforms a built model passes through before the optimizer sees it.

Each transform is one small class: its ``name``, what it must come ``after`` (and, for a
transform slotted in later, what it must come ``before``), each with the reason in one line,
whether it ``applies`` to the run's config, and ``apply``, which returns the one line it logs.
``check_order`` refuses a list that breaks a declared constraint, naming both transforms, so the
order is checked at start-up instead of being remembered in comments. Adding a transform is one
class and one entry in ``TRANSFORMS``.

The transforms act on ``ModelBuild``: the model chunks (one per virtual pipeline stage) and,
once ``ddp`` has run, their DDP wrappers. A graph router is kept on the chunk it serves, as
``decoder_graphs`` / ``vision_graphs``, where the optimizer, the evaluation and the log read it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from models.common.layout_init import init_layout_independent
from models.performance import layer_graphs, wgrad_fusion
from multimodal.config import Config, ConfigError, vision_warmup_patches
from multimodal.freeze import describe as describe_freeze
from multimodal.freeze import freeze
from multimodal.lora import apply_lora
from multimodal.platform import Runtime

log = logging.getLogger(__name__)


@dataclass
class ModelBuild:
    """What the transforms act on."""
    cfg: Config
    rt: Runtime
    chunks: list[torch.nn.Module]  # one per virtual pipeline stage, built and on the device
    ddp: list[DistributedDataParallel] = field(default_factory=list)  # one per chunk, from the ``ddp`` transform


class ModelTransform:
    name: ClassVar[str]
    after: ClassVar[dict[str, str]] = {}   # transform name -> why this one must run later
    before: ClassVar[dict[str, str]] = {}  # transform name -> why this one must run earlier

    def applies(self, cfg: Config, rt: Runtime) -> bool:
        """Whether this run wants it; a setting that cannot run here raises ConfigError (at start)."""
        return True

    def apply(self, build: ModelBuild) -> str:
        """Transform ``build`` in place; returns the one line logged about what was done."""
        raise NotImplementedError


class LayoutInit(ModelTransform):
    name = "layout_init"

    def applies(self, cfg, rt):
        return getattr(cfg.model, "init", "layout_independent") == "layout_independent"

    def apply(self, build):
        # each weight drawn from train.seed and its global name: the same model in any layout
        drawn = kept = 0
        for chunk in build.chunks:
            counts = init_layout_independent(chunk, build.cfg.train.seed)
            drawn, kept = drawn + counts["tensors"], kept + counts["kept"]
        return f"layout-independent init: {drawn} tensors drawn, {kept} kept as built"


class Freeze(ModelTransform):
    name = "freeze"
    after = {"layout_init": "the init draws every weight of the built model, frozen ones included"}

    def apply(self, build):
        counts: dict[str, tuple[int, int]] = {}
        for chunk in build.chunks:
            for group, (trainable, total) in freeze(chunk, build.cfg.model.freeze).items():
                a, b = counts.get(group, (0, 0))
                counts[group] = (a + trainable, b + total)
        return describe_freeze(counts)


class Lora(ModelTransform):
    name = "lora"
    after = {"layout_init": "the adapters keep their own init (B = 0), which a later draw would overwrite",
             "freeze": "freezing after LoRA would freeze the adapters of a frozen group too"}

    def applies(self, cfg, rt):
        return bool(cfg.model.lora.rank)

    def apply(self, build):
        return "; ".join(apply_lora(chunk, build.cfg.model.lora) for chunk in build.chunks)


class Recompute(ModelTransform):
    name = "recompute"
    after = {"lora": "it checkpoints the layers' forwards as LoRA leaves them, adapters included"}

    def applies(self, cfg, rt):
        return bool(cfg.train.recompute_modules)

    def apply(self, build):
        from multimodal.performance.recompute import apply_recompute

        modules = build.cfg.train.recompute_modules
        changed = sum(apply_recompute(chunk, modules) for chunk in build.chunks)
        return f"recompute {', '.join(modules)}: {changed} block(s)"


class Fp8(ModelTransform):
    name = "fp8"
    # (it replaces each layer's GEMM function only: weights, LoRA hooks, recompute wrappers, DDP
    # buffers and the grad-accumulation flag are untouched, so it needs nothing before it)
    before = {"decoder_graphs": "the graphs capture the GEMMs the layers have at capture time",
              "vision_graphs": "the graphs capture the GEMMs the layers have at capture time"}

    def applies(self, cfg, rt):
        return cfg.train.fp8 is not None

    def apply(self, build):
        from models.common.fp8 import convert

        t = build.cfg.train
        return "; ".join(convert(chunk, t.fp8, t.fp8_exclude).line() for chunk in build.chunks)


class DDPWrap(ModelTransform):
    name = "ddp"
    after = {"layout_init": "DDP's buffers take the weights as they are at the wrap",
             "freeze": "DDP gives a gradient buffer to every weight that requires a gradient at the wrap",
             "lora": "the adapters need gradient buffers and the frozen base weights none"}

    def apply(self, build):
        p = build.cfg.parallel
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=p.overlap_grad_reduce,
            use_distributed_optimizer=p.use_distributed_optimizer,
            average_in_collective=False,  # per-token loss: the one division is by the token count
        )
        build.ddp = [DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk)
                     for chunk in build.chunks]
        return (f"DDP over {len(build.ddp)} model chunk(s): fp32 gradient buffers, overlap_grad_reduce="
                f"{p.overlap_grad_reduce}, distributed optimizer={p.use_distributed_optimizer}")


def _graphed_decoder_adds_to_main_grad(cfg: Config, rt: Runtime) -> bool:
    """Whether graphed decoder layers add their gradients into main_grad (what makes the fusion pay)."""
    g = cfg.train.cuda_graphs
    return bool(rt.is_cuda and g.enabled and g.grads_to_main_grad and layer_graphs.decoder_layers_graphable(cfg.model) is None)


class WgradFusion(ModelTransform):
    name = "wgrad_fusion"
    after = {"ddp": "the fused backward accumulates into DDP's main_grad buffers"}

    def applies(self, cfg, rt):
        return wgrad_fusion.resolve(cfg.model.grad_accum_fusion, _graphed_decoder_adds_to_main_grad(cfg, rt))

    def apply(self, build):
        fused = sum(wgrad_fusion.enable(d) for d in build.ddp)
        return f"weight-gradient accumulation fusion: {fused} weights (linear layers, embedding, LM head)"


def _graphs_wanted(cfg: Config, rt: Runtime) -> bool:
    if cfg.train.cuda_graphs.enabled and not rt.is_cuda:
        raise ConfigError("train.cuda_graphs=true needs a GPU; set it to false here")
    return cfg.train.cuda_graphs.enabled


class DecoderGraphs(ModelTransform):
    name = "decoder_graphs"
    after = {"ddp": "the graphs are captured on DDP's gradient hooks and buffers",
             "wgrad_fusion": "the graphs capture the fusion's main_grad writes"}

    def applies(self, cfg, rt):
        if not _graphs_wanted(cfg, rt):
            return False
        eager = layer_graphs.decoder_layers_graphable(cfg.model)
        if eager is not None:
            log.info("CUDA graphs: vision encoder only; %s", eager)
        return eager is None

    def apply(self, build):
        g, m = build.cfg.train.cuda_graphs, build.cfg.model
        # one-sample rows take cuDNN attention under `auto` (models/common/attention.py): their own graphs
        one_segment = layer_graphs.one_segment_set_wanted(m.attention_backend, build.rt.device)
        for chunk in build.chunks:
            chunk.decoder_graphs = layer_graphs.graph_decoder_layers(
                chunk.language_model, g.max_samples, one_segment_graphs=one_segment,
                grads_to_main_grad=g.grads_to_main_grad)
        return (f"CUDA graphs: decoder layers, up to {g.max_samples} samples per row"
                f"{', one-sample rows apart' if one_segment else ''}")


class VisionGraphs(ModelTransform):
    name = "vision_graphs"
    after = DecoderGraphs.after

    def applies(self, cfg, rt):
        return _graphs_wanted(cfg, rt) and bool(cfg.train.cuda_graphs.vision_bucket)

    def apply(self, build):
        g = build.cfg.train.cuda_graphs
        graphed = 0
        for chunk in build.chunks:
            vision = getattr(chunk, "vision_model", None)  # first pipeline stage only
            if hasattr(vision, "install_cuda_graphs"):  # the model's own router
                chunk.vision_graphs = vision.install_cuda_graphs(
                    g.vision_bucket, g.vision_max_buckets, g.max_samples, grads_to_main_grad=g.grads_to_main_grad,
                    warmup_patches=vision_warmup_patches(build.cfg))
                graphed += 1
        if not graphed:
            return "CUDA graphs: no vision encoder on this pipeline stage (or none that graphs)"
        return f"CUDA graphs: vision encoder, buckets of {g.vision_bucket} patches"


# The order every run uses. Optional transforms that do not apply are skipped, never reordered.
TRANSFORMS: tuple[ModelTransform, ...] = (
    LayoutInit(), Freeze(), Lora(), Recompute(), Fp8(),
    DDPWrap(), WgradFusion(), DecoderGraphs(), VisionGraphs(),
)


def check_order(transforms) -> None:
    """Refuse, in one line, a list that breaks an ``after`` / ``before`` constraint or names an
    unknown transform."""
    position = {t.name: i for i, t in enumerate(transforms)}
    if len(position) != len(transforms):
        raise RuntimeError(f"model transforms: a name appears twice in {[t.name for t in transforms]}")
    for i, t in enumerate(transforms):
        for other, why in t.after.items():
            if other not in position:
                raise RuntimeError(f"model transform {t.name!r} must come after {other!r}, which is not in the list")
            if position[other] > i:
                raise RuntimeError(f"model transform {t.name!r} must come after {other!r} ({why}), "
                                   "but the list has it before")
        for other, why in t.before.items():
            if other not in position:
                raise RuntimeError(f"model transform {t.name!r} must come before {other!r}, which is not in the list")
            if position[other] < i:
                raise RuntimeError(f"model transform {t.name!r} must come before {other!r} ({why}), "
                                   "but the list has it after")


def plan(cfg: Config, rt: Runtime, transforms=None) -> list[ModelTransform]:
    """The transforms this run applies (default: ``TRANSFORMS``), in order; the order checked and
    every setting that cannot run here refused before anything is built."""
    transforms = TRANSFORMS if transforms is None else transforms
    check_order(transforms)
    planned = [t for t in transforms if t.applies(cfg, rt)]
    skipped = [t.name for t in transforms if t not in planned]
    log.info("model transforms, in order: %s%s", ", ".join(t.name for t in planned),
             f" (not wanted by this config: {', '.join(skipped)})" if skipped else "")
    return planned


def apply_all(build: ModelBuild, planned: list[ModelTransform]) -> ModelBuild:
    """Apply ``planned`` (from ``plan``) in order, one log line each."""
    for t in planned:
        log.info("model transform %s: %s", t.name, t.apply(build))
    return build


def graphs_of(chunks) -> list:
    """The CUDA graph routers the graph transforms installed on ``chunks`` (decoder and vision)."""
    routers = [getattr(chunk, attr, None) for chunk in chunks for attr in ("decoder_graphs", "vision_graphs")]
    return [g for g in routers if g is not None]
