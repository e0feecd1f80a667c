"""The optimizer and its learning-rate schedule, built in one place that owns the order of the
patches laid over megatron's optimizer (each patch's module, in multimodal/performance/, says
what it does and why):

1. ``multi_tensor.use_foreach_kernels``: torch's ``_foreach`` kernels where megatron would loop in
   Python without Transformer Engine / Apex (before megatron builds the optimizer);
2. megatron's optimizer over the DDP-wrapped model;
3. ``multi_tensor.use_fused_adam`` (``optimizer.fused``) and ``defer_grad_scaling``: the 1/tokens
   scale and the clip coefficient applied inside the fused AdamW kernel;
4. ``flat_adamw_patch.use_flat_adamw`` (``optimizer.flat``): one AdamW kernel over flat buffers,
   before any step, because CUDA graphs capture parameter addresses;
5. ``overlap_update.overlap_update_with_forward`` (``optimizer.overlap_step``): the update of each
   piece of the model runs as the next forward reaches it; needs 4.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from multimodal.performance import flat_adamw_patch, multi_tensor, overlap_update


def build_optimizer(cfg, model, ddp, dtype: torch.dtype):
    """(optimizer, scheduler) for ``model`` wrapped as ``ddp``, every patch applied in order; with
    virtual pipeline stages ``model`` / ``ddp`` are the lists of this rank's chunks and their wrappers
    (one optimizer over all of them, as megatron's schedule expects)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    ddps = list(ddp) if isinstance(ddp, (list, tuple)) else [ddp]
    o = cfg.optimizer
    opt_cfg = McoreOptimizerConfig(
        optimizer=o.name,
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
    )
    multi_tensor.use_foreach_kernels()  # torch _foreach kernels where megatron would loop in Python (no TE/Apex)
    optimizer = get_megatron_optimizer(opt_cfg, ddps)
    if o.fused:
        multi_tensor.use_fused_adam(optimizer)
        if o.defer_grad_scaling:
            multi_tensor.defer_grad_scaling(optimizer, ddps)
    flat_adamw_patch.use_flat_adamw(optimizer, ddps, o.flat)  # before any step: the graphs capture param addresses
    # the vision encoder replays all its blocks as one graph: its parameters are gated as one unit
    opaque = [c.vision_model for c in chunks if getattr(c, "vision_graphs", None) is not None]
    gated = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)
    overlap_update.overlap_update_with_forward(gated, optimizer, o.overlap_step, opaque=opaque,
                                               pieces=o.overlap_step_pieces)
    decay = o.decay_iters or cfg.train.iters
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=min(o.warmup_iters, decay - 1) if decay > 1 else 0,
        lr_decay_steps=max(decay, 1),
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=max(decay, 1),
        wd_incr_style="constant",
    )
    return optimizer, scheduler
