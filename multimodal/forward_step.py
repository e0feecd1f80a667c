"""forward_step: micro-batch from the loader -> device tensors -> model -> loss closure.

All model-specific batch handling lives here, not in the training loop. Everything the
device needs is copied once per micro-batch with ``non_blocking``; host-side metadata
(sample lengths, max_seqlen, image grids) stays on the host so no layer has to sync.
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from multimodal.loss import masked_token_loss


def to_device(batch: dict, device: torch.device, pixel_dtype: torch.dtype) -> dict:
    out = dict(batch)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        out[key] = batch[key].to(device, non_blocking=True)
    out["pixel_values"] = batch["pixel_values"].to(device, pixel_dtype, non_blocking=True)
    if batch.get("cu_seqlens") is not None:
        out["cu_seqlens"] = batch["cu_seqlens"].to(device, non_blocking=True)
    return out


def packed_seq_params(batch: dict) -> PackedSeqParams | None:
    cu = batch.get("cu_seqlens")
    if cu is None:
        return None
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=batch["max_seqlen"],
        max_seqlen_kv=batch["max_seqlen"],
    )


class ForwardStep:
    """Callable for megatron's forward_backward_func; records host-side batch stats."""

    def __init__(self, device: torch.device, pixel_dtype: torch.dtype):
        self.device, self.pixel_dtype = device, pixel_dtype
        self.batches: list[dict] = []  # host metadata of this step's micro-batches (for FLOPs)

    def __call__(self, data_iterator, model):
        batch = next(data_iterator)
        self.batches.append(
            {k: batch[k] for k in ("sample_lengths", "num_real_tokens", "image_grid_thw")}
        )
        b = to_device(batch, self.device, self.pixel_dtype)
        output = model(
            b["tokens"],
            b["position_ids"],
            labels=b["labels"],
            pixel_values=b["pixel_values"],
            image_grid_thw=b["image_grid_thw"],
            packed_seq_params=packed_seq_params(b),
        )
        return output, partial(masked_token_loss, loss_mask=b["loss_mask"])
