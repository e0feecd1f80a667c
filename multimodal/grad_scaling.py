"""Gradients scaled exactly once: by 1/(supervised tokens of the global batch).

``install`` gives megatron's schedule the hooks it calls (DDP's no_sync, our finalize_grads, the
optimizer's loss scale) and then checks the whole contract once, before any compute.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from megatron.core import parallel_state as ps
from megatron.core.distributed import finalize_model_grads

from multimodal.loss import masked_token_loss


def install(chunks: list, ddp: list, optimizer) -> None:
    """megatron's schedule calls these: DP grad reduction once per step, scaled once by the total
    number of supervised tokens (calculate_per_token_loss)."""
    no_sync = [d.no_sync for d in ddp]
    for chunk in chunks:
        tcfg = chunk.config
        tcfg.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync  # megatron takes one per chunk
        tcfg.finalize_model_grads_func = finalize_grads
        tcfg.grad_scale_func = optimizer.scale_loss
    for d in ddp:
        check_gradient_scaling(d)


def finalize_grads(model, num_tokens, pg_collection=None, force_all_reduce=False):
    """megatron's finalize_model_grads, then one coalesced TP all-reduce (sum) of the grads of
    replicated parameters that only see this rank's heads (``tp_partial_grad``, set by the model
    builder). Sums commute with the DP reduction and the 1/tokens scaling done before, and under
    the distributed optimizer TP peers hold the same DP shard, so this is exact in every mode."""
    finalize_model_grads(model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    tp_group = ps.get_tensor_model_parallel_group()
    if tp_group.size() == 1:
        return
    grads = [p.main_grad for chunk in model for p in chunk.parameters()
             if p.requires_grad and getattr(p, "tp_partial_grad", False)]
    if grads:
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=tp_group)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


def check_gradient_scaling(ddp) -> None:
    """Fail at start-up on any setting that would scale gradients more than once.

    Our loss (multimodal.loss) returns the *sum* of masked token losses and the token count.
    With ``calculate_per_token_loss`` megatron-core 0.19.2 then: does not divide the loss by
    the micro-batch's tokens or by num_microbatches (schedules.forward_step_calc_loss), does
    not pre-scale the DP gradient reduction (DDP gradient_scaling_factor 1.0, SUM collective),
    sums the token counts over micro-batches, broadcasts them from the last pipeline stage and
    all-reduces them over DP x CP, and divides the gradients once by that total
    (finalize_model_grads, called by our finalize_grads). Any of the following would add a
    second factor (1/num_microbatches, 1/DP or 1/(DP*CP)) on top of 1/tokens, so each one is
    refused here.
    """
    cfg = ddp.config  # what the schedule reads (get_model_config)
    problems = []
    if not cfg.calculate_per_token_loss:
        problems.append("calculate_per_token_loss is False: megatron would divide our summed loss by its "
                        "token count and num_microbatches, and the DDP reduction by the DP size")
    if ddp.module.config is not cfg and not ddp.module.config.calculate_per_token_loss:
        problems.append("the model's config and the DDP wrapper's config disagree on calculate_per_token_loss")
    if ddp.ddp_config.average_in_collective:
        problems.append("DDP average_in_collective=True divides gradients by the DP size in the collective")
    for buf in [*ddp.buffers, *ddp.expert_parallel_buffers]:
        if buf.gradient_scaling_factor != 1.0:
            problems.append(f"a DDP gradient buffer pre-scales gradients by {buf.gradient_scaling_factor}")
            break
    # our loss's side of the contract: a sum over supervised tokens, not a mean
    loss_sum, num_tokens, _ = masked_token_loss(torch.full((1, 4), 2.0), torch.tensor([[1.0, 1.0, 0.0, 1.0]]))
    if float(loss_sum) != 6.0 or int(num_tokens) != 3:
        problems.append(f"the loss function must return (sum of masked token losses, token count); got "
                        f"({float(loss_sum)}, {int(num_tokens)}) for 3 tokens of loss 2.0")
    if cfg.finalize_model_grads_func is not finalize_grads:
        problems.append("finalize_model_grads_func is not ours (megatron's finalize_model_grads + TP sums), so "
                        "the one division by the global token count would not happen (or would happen elsewhere)")
    if problems:
        raise RuntimeError("gradient scaling would not be exactly 1/(supervised tokens of the global batch): "
                           + "; ".join(problems))
