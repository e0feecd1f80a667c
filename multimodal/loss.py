"""Masked token loss, returned in megatron's per-token-loss form.

With ``calculate_per_token_loss`` megatron sums each micro-batch's ``(loss_sum, num_tokens)``
over micro-batches and the data-parallel group and divides gradients once by the total
token count (``finalize_model_grads``). So the global loss is the mean over every
supervised token of the global batch, whatever the packing, and is never divided twice.
"""

from __future__ import annotations

import torch


def masked_token_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor, mtp_out: dict | None = None):
    """per_token_loss, loss_mask: [B, S]. Returns (loss_sum, num_tokens, report).

    ``mtp_out``: what the model's MTP depths left (models/common/mtp.py ``mtp_losses``): their
    term joins the loss sum that is backpropagated, already weighted so that megatron's one
    division by the LM token count gives ``model.mtp_loss_scale`` x the mean MTP loss; their
    [sum, tokens] is reported on its own as "mtp loss"."""
    mask = loss_mask.to(per_token_loss.dtype).reshape(-1)
    loss_sum = (per_token_loss.float().reshape(-1) * mask.float()).sum()
    num_tokens = mask.sum().to(torch.int)
    # report: [loss_sum, num_tokens] summed over micro-batches (and DP for logging)
    report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
    if mtp_out is None:
        return loss_sum, num_tokens, {"lm loss": report}
    return loss_sum + mtp_out["loss"], num_tokens, {"lm loss": report, "mtp loss": mtp_out["report"]}
