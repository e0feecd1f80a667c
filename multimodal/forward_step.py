"""forward_step: micro-batch from the loader -> device tensors -> model -> loss closure.

All model-specific batch handling lives here, not in the training loop. Everything the
device needs is copied once per micro-batch asynchronously (from pinned memory); host-side metadata
(sample lengths, max_seqlen, image grids) stays on the host so no layer has to sync.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from functools import partial

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from core.transfer import to_device_async
from core.vision_tokens import vision_token_mask
from models.common.mtp import shift_batch
from models.common.packed_seq import CPPackedSeqParams, PackedRowParams
from multimodal.context_parallel import partition_batch
from multimodal.loss import masked_token_loss


def to_device(batch: dict, device: torch.device, pixel_dtype: torch.dtype, with_pixels: bool = True,
              row_extras: Callable[..., dict] | None = None) -> dict:
    """The micro-batch with its tensors on ``device``. ``row_extras``: the model family's
    ``packed_row_extras``, called once per packed batch with its host cu_seqlens (the padded ones
    when given); its fields reach the layers in ``PackedRowParams`` (``packed_seq_params``)."""
    out = dict(batch)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        out[key] = to_device_async(batch[key], device)
    if with_pixels:
        out["pixel_values"] = to_device_async(batch["pixel_values"], device).to(pixel_dtype)
    else:  # later pipeline stages have no vision encoder: do not ship the pixels
        out["pixel_values"] = None
    for key in ("padding_mask", "vision_gather_index", "cu_seqlens", "cu_seqlens_padded", "cp_gather_order", "cp_restore_order", "image_feature_index"):
        if batch.get(key) is not None:
            out[key] = to_device_async(batch[key], device)
    cu = batch.get("cu_seqlens_padded")
    cu = batch.get("cu_seqlens") if cu is None else cu
    if cu is not None and row_extras is not None:
        out["row_extras"] = row_extras(cu, device)
    return out


def packed_seq_params(batch: dict, cp_group=None) -> PackedSeqParams | None:
    """THD metadata for the model; under context parallelism also the all-to-all reorder
    indices (then BSHD batches get one too, with qkv_format "sbhd")."""
    cu = batch.get("cu_seqlens")
    cu_padded = batch.get("cu_seqlens_padded")
    if cu_padded is None:
        cu_padded = cu
    fields = {}
    if cu is not None:
        fields = dict(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded, max_seqlen_q=batch["max_seqlen"], max_seqlen_kv=batch["max_seqlen"],
            **batch.get("row_extras", {}),
        )
    if batch.get("cp_size", 1) > 1:
        return CPPackedSeqParams(
            **(fields or {"qkv_format": "sbhd"}), cp_size=batch["cp_size"], cp_rank=batch["cp_rank"],
            cp_mixer_group=cp_group, gather_order=batch["cp_gather_order"], restore_order=batch["cp_restore_order"],
        )
    return PackedRowParams(**fields) if fields else None


def loss_token_index(loss_mask: torch.Tensor) -> torch.Tensor:
    """Host loss mask [B, S] -> flat indices (s * B + b, the decoder's [S, B] order) of the tokens
    with a nonzero mask: where the sparse LM head computes logits (``model.sparse_lm_head``)."""
    return (loss_mask.transpose(0, 1).reshape(-1) != 0).nonzero().squeeze(1)


def vision_gather(batch: dict, cp_group):
    """(index, width, group, rank) for MultimodalModel when the batch's images are split over CP."""
    if batch.get("vision_gather_index") is None:
        return None
    return batch["vision_gather_index"], batch["vision_gather_width"], cp_group, batch["cp_rank"]


def chunk_iterators(batches: Iterator[dict], num_chunks: int) -> Iterator[dict] | list[Iterator[dict]]:
    """What megatron's schedule takes as ``data_iterator`` for ``num_chunks`` model chunks: the loader
    itself for one, else one iterator per chunk, each yielding every micro-batch of ``batches``.

    The interleaved schedule calls the forward step once per chunk per micro-batch, pulling from
    that chunk's iterator; every chunk needs the micro-batch (all of them rotate by the MRoPE
    position ids and cut packed rows at ``cu_seqlens``; the first also embeds it, the last scores
    it), so each chunk reads the same rows. A chunk runs at most about pp x vpp micro-batches
    ahead of the last one, which bounds what the shared buffer holds."""
    if num_chunks == 1:
        return batches
    return list(itertools.tee(batches, num_chunks))


def _unwrap(model):
    while hasattr(model, "module"):  # megatron DDP / Float16Module wrappers
        model = model.module
    return model


def schedule_seq_length(chunks: list, seq_length: int) -> int:
    """``seq_length`` for megatron's schedule, which sizes the buffers of what one pipeline stage
    sends the next by it: ``stage_tokens_per_token`` blocks of the sequence (hidden states, then
    the MTP input embeddings; models/base.py)."""
    return seq_length * getattr(_unwrap(chunks[0]), "stage_tokens_per_token", 1)


class ForwardStep:
    """Callable for megatron's forward_backward_func; records host-side batch stats."""

    def __init__(self, device: torch.device, pixel_dtype: torch.dtype, cp_size: int = 1, cp_rank: int = 0,
                 cp_group=None, image_token_id: int | tuple[int, ...] | None = None, cp_split_vision: bool = False, merge: int = 2,
                 sparse_lm_head: bool = False, row_extras: Callable[..., dict] | None = None):
        self.device, self.pixel_dtype = device, pixel_dtype
        self.row_extras = row_extras  # ModelFamily.packed_row_extras of the model being run
        # model.sparse_lm_head (with the fused loss): logits only at the loss tokens of packed batches
        self.sparse_lm_head = sparse_lm_head
        self.cp_size, self.cp_rank, self.cp_group = cp_size, cp_rank, cp_group
        self.image_token_id = image_token_id
        self.cp_split_vision, self.merge = cp_split_vision, merge
        self.batches: list[dict] = []  # host metadata of this step's micro-batches (for FLOPs)

    def __call__(self, data_iterator, model, return_schedule_plan: bool = False):
        """-> (model output, loss closure). With ``parallel.moe_a2a_overlap`` megatron's combined-1F1B
        schedule calls this with ``return_schedule_plan=True`` and ``model`` unwrapped down to the
        module that has ``build_schedule_plan``; the first element is then that plan (it runs the
        forward later, interleaved with another micro-batch's backward) and megatron applies the
        same loss closure to the plan's output."""
        batch = next(data_iterator)
        inner = _unwrap(model)
        # with virtual stages each chunk runs every micro-batch: one chunk a rank counts it (the last,
        # which on the last rank holds the LM head and MTP, as a rank without virtual stages does)
        records = getattr(inner, "counts_batches", True)
        stats = {k: batch[k] for k in ("sample_lengths", "num_real_tokens", "image_grid_thw")}
        loss_tokens = int((batch["loss_mask"] != 0).sum())  # of the whole micro-batch, before any CP split
        lm = getattr(inner, "language_model", None)
        # every stage: the first embeds the shifted tokens, the last scores them (models/base.py)
        mtp_depth = getattr(inner, "mtp_depth", 0)
        # shifted on the whole micro-batch, before the CP split: no shift ever crosses a chunk
        shifted = shift_batch(batch, mtp_depth, self.image_token_id) if mtp_depth else None
        # each depth's loss tokens in the whole micro-batch (its shifted mask)
        mtp_tokens = [int((m != 0).sum()) for m in shifted["mtp_loss_mask"]] if shifted is not None else []
        if self.cp_size > 1:  # every CP rank read the same micro-batch; keep this rank's chunks
            batch = partition_batch(batch, self.cp_size, self.cp_rank, self.image_token_id,
                                    split_vision=self.cp_split_vision, merge=self.merge)
        b = to_device(batch, self.device, self.pixel_dtype, with_pixels=getattr(inner, "pre_process", True),
                      row_extras=self.row_extras)
        params = packed_seq_params(b, self.cp_group)
        # packed (or CP-split) batches have PackedRowParams, which carry the loss-token indices
        sparse = self.sparse_lm_head and params is not None
        if sparse:
            params.loss_token_index = to_device_async(loss_token_index(batch["loss_mask"]), self.device)
        # tokens the LM head runs on (for FLOPs): the loss tokens, or None for every real token; the
        # MTP depths share the head and are sparse alike (their loss tokens, all depths together)
        if records:
            self.batches.append({**stats, "lm_head_tokens": loss_tokens if sparse else None, "mtp_depth": mtp_depth,
                                 "mtp_head_tokens": sum(mtp_tokens) if sparse and mtp_depth else None})
        mtp = self._mtp_inputs(shifted, batch, loss_tokens, mtp_tokens, lm, sparse) if shifted is not None else None
        run = model.build_schedule_plan if return_schedule_plan else model
        output = run(
            b["tokens"],
            b["position_ids"],
            labels=b["labels"],
            pixel_values=b["pixel_values"],
            image_grid_thw=b["image_grid_thw"],
            packed_seq_params=params,
            image_feature_index=b.get("image_feature_index"),
            padding_mask=b.get("padding_mask"),
            vision_gather=vision_gather(b, self.cp_group),
            **({"mtp": mtp} if mtp is not None else {}),
        )
        return output, partial(masked_token_loss, loss_mask=b["loss_mask"],
                               mtp_out=mtp["out"] if mtp is not None else None)

    def _mtp_inputs(self, shifted: dict, batch: dict, loss_tokens: int, mtp_tokens: list[int], lm,
                    sparse: bool) -> dict:
        """This rank's share of the shifted MTP tensors on the device, the vision-feature rows of
        their image tokens, the per-depth (LM tokens / MTP tokens) of the micro-batch (host
        numbers, the same on every CP rank; models/common/mtp.py ``mtp_losses``) and, with the
        sparse LM head, each depth's loss-token indices (where the shared head computes logits)."""
        ratios = [loss_tokens / max(n, 1) for n in mtp_tokens]
        if self.cp_size > 1:
            share = batch["cp_gather_order"].numel() // self.cp_size
            local = batch["cp_gather_order"][self.cp_rank * share:(self.cp_rank + 1) * share]
            shifted = {k: v[:, :, local] for k, v in shifted.items()}
        is_image = [vision_token_mask(t, self.image_token_id) for t in shifted["mtp_tokens"]]
        feature_index = [o[m] for o, m in zip(shifted["mtp_ordinal"], is_image)]
        dev = {k: to_device_async(shifted[k], self.device) for k in ("mtp_tokens", "mtp_labels", "mtp_loss_mask")}
        index = [to_device_async(loss_token_index(m), self.device) for m in shifted["mtp_loss_mask"]] if sparse else None
        return {"tokens": dev["mtp_tokens"], "labels": dev["mtp_labels"], "loss_mask": dev["mtp_loss_mask"],
                "feature_index": [to_device_async(i, self.device) for i in feature_index],
                "token_index": index, "ratios": ratios, "scale": lm.mtp_loss_scale, "out": {}}
