"""Training's public entry: ``train(cfg)`` sets up the process groups and runs a ``Trainer``.

The run's state and its loop are multimodal/trainer.py; the transforms the built model passes
through, in their checked order, multimodal/transforms.py; the log steps, multimodal/step_metrics.py;
the one-division gradient scaling contract, multimodal/grad_scaling.py. The names below stay
importable from here for the entry point, the scripts and the tests.
"""

from __future__ import annotations

import logging

import torch
from megatron.core import parallel_state as ps

from core.kernel_cache import describe as describe_kernel_cache
from core.kernel_cache import use_kernel_cache
from models import get_model_family
from multimodal import hf_convert, platform
from multimodal.config import Config, ConfigError, resolve_sources, validate
from multimodal.grad_scaling import check_gradient_scaling, finalize_grads
from multimodal.platform import Runtime, init_distributed
from multimodal.step_metrics import Window as _Window  # the fault tests patch its add through this name
from multimodal.step_metrics import param_norm as _param_norm
from multimodal.trainer import TrainResult, Trainer, build_model, checkpoint_meta, forward_step, resolve_dtype

__all__ = ["TrainResult", "Trainer", "build_model_and_optimizer", "check_gradient_scaling", "checkpoint_meta",
           "finalize_grads", "forward_step", "resolve_dtype", "train", "_Window", "_param_norm"]

log = logging.getLogger(__name__)


def _forget_earlier_runs() -> None:
    """megatron-core keeps process-global state from one run to the next: the parallel groups, and
    the MoE aux-loss scale, a tensor whose shape the first run fixed (a later run's copy into it
    fails). A run in a process that already ran one (a notebook, a conversion called first, the
    test suite) starts from neither."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler  # noqa: PLC0415

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None


def train(cfg: Config) -> TrainResult:
    rt = init_distributed()
    _forget_earlier_runs()
    if cfg.parallel.moe_a2a_overlap and not rt.is_cuda and not platform.CPU_STREAM_STAND_INS:
        raise ConfigError("parallel.moe_a2a_overlap=true needs GPUs: megatron-core runs the overlapped "
                          "all-to-alls on their own CUDA streams; set parallel.moe_a2a_overlap=false here")
    resolve_sources(cfg)
    validate(cfg, rt.world_size)
    if rt.is_cuda and cfg.train.kernel_cache:  # before the first kernel compiles (the model build)
        log.info(describe_kernel_cache(use_kernel_cache(cfg.train.kernel_cache), cfg.train.kernel_cache))
    p = cfg.parallel
    hf_plan = None
    if cfg.checkpoint.load and hf_convert.is_hf_folder(cfg.checkpoint.load):
        # where each stored tensor sits in the TP=1 model: megatron reads its layout from the global
        # parallel state, so this is worked out before the run's own layout is set up
        hf_plan = hf_convert.reference_plan(cfg.model, get_model_family(cfg.model.name))
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep,
        virtual_pipeline_model_parallel_size=p.vpp if p.vpp > 1 else None,
    )
    try:
        return Trainer(cfg, rt, hf_plan).run()
    finally:
        ps.destroy_model_parallel()


def build_model_and_optimizer(cfg: Config, rt: Runtime, dtype: torch.dtype):
    """(model, ddp, optimizer, scheduler) as a one-chunk run builds them (model transforms, optimizer,
    gradient hooks): for tools and tests that drive the optimizer themselves."""
    built, optimizer, scheduler = build_model(cfg, rt, dtype)
    return built.chunks[0], built.ddp[0], optimizer, scheduler
