"""Context parallelism (CP) for packed multimodal batches: the host-side split.

Layout (load balanced "zigzag", core/zigzag.py): every packed sample (every
``cu_seqlens_padded`` segment, or every row of a BSHD batch) is cut into ``2*cp`` equal chunks
and CP rank r keeps chunks r and 2*cp-1-r, so each rank holds the same number of tokens of every
sample and the causal work is balanced. Tokens, labels, loss mask and MRoPE position ids are
split the same way on the host (``partition_batch``), before the batch goes to the device.

Inside the model, mixers see the whole sequence through head-parallel all-to-all
(models/common/cp_collectives.py); everything they need rides on ``CPPackedSeqParams``
(models/common/packed_seq.py), built from this split's orders (multimodal/forward_step.py).
"""

from __future__ import annotations

import math

import torch

from core.vision_tokens import vision_token_mask
from core.zigzag import zigzag_indices


def _segments(batch: dict) -> list[int]:
    cu = batch.get("cu_seqlens_padded")
    if cu is None:
        cu = batch.get("cu_seqlens")
    if cu is None:  # BSHD: every row is one segment
        return [batch["tokens"].shape[1]]
    cu = cu.tolist()
    return [e - s for s, e in zip(cu[:-1], cu[1:])]


def partition_batch(batch: dict, cp: int, rank: int, image_token_id: int | tuple[int, ...], split_vision: bool = False,
                    merge: int = 2) -> dict:
    """This CP rank's share of a collated (host) micro-batch, plus the reorder metadata.

    Added keys: ``cp_gather_order``, ``cp_restore_order`` (see CPPackedSeqParams,
    models/common/packed_seq.py) and
    ``image_feature_index``: for every local image token, in local order, its ordinal among
    all image tokens of the batch, i.e. which row of the vision features it receives.
    Host metadata (sample lengths, grids, real-token counts) stays that of the whole batch.
    With ``split_vision`` each rank encodes only its share of the images (``_split_images``)
    instead of all of them.
    """
    segments = _segments(batch)
    order = torch.cat([zigzag_indices(segments, cp, r) for r in range(cp)])
    share = order.numel() // cp
    local = order[rank * share:(rank + 1) * share]  # every rank holds the same number of tokens
    out = dict(batch)
    for key in ("tokens", "labels", "loss_mask", "padding_mask"):
        if batch.get(key) is not None:
            out[key] = batch[key][:, local]
    out["position_ids"] = batch["position_ids"][:, :, local]
    is_image = vision_token_mask(batch["tokens"], image_token_id)  # [B, S]: image and video tokens
    ordinal = is_image.reshape(-1).cumsum(0).reshape(is_image.shape) - 1
    out["image_feature_index"] = ordinal[:, local][is_image[:, local]]
    out["cp_gather_order"] = order
    out["cp_restore_order"] = torch.argsort(order)
    out["cp_size"], out["cp_rank"] = cp, rank
    if split_vision and batch["image_grid_thw"].numel():
        out.update(_split_images(batch, cp, rank, merge))
    return out


def _split_images(batch: dict, cp: int, rank: int, merge: int) -> dict:
    """Give each CP rank whole images to encode (largest first, to the least-loaded rank), and
    the index that puts every rank's features back into the batch's image order after an
    all-gather padded to the busiest rank's row count (``VisionGather``, models/common/cp_collectives.py)."""
    grids = batch["image_grid_thw"].reshape(-1, 3)
    patches = grids.prod(dim=1).tolist()
    feats = [n // merge**2 for n in patches]
    load, owner = [0] * cp, [0] * len(patches)
    for i in sorted(range(len(patches)), key=lambda i: -patches[i]):
        r = min(range(cp), key=lambda r: load[r])
        owner[i], load[r] = r, load[r] + patches[i]
    mine = [i for i in range(len(patches)) if owner[i] == rank]  # in batch order
    starts = [0, *torch.tensor(patches).cumsum(0).tolist()]
    rows = [torch.arange(starts[i], starts[i + 1]) for i in mine]
    pixel_values = batch["pixel_values"][torch.cat(rows)] if rows else batch["pixel_values"][:0]
    per_rank = [sum(feats[i] for i in range(len(feats)) if owner[i] == r) for r in range(cp)]
    width = max(per_rank)
    offset = [r * width for r in range(cp)]  # where rank r's features start in the gathered buffer
    index = []
    for i in range(len(feats)):  # global feature order: image by image
        r = owner[i]
        index.append(torch.arange(offset[r], offset[r] + feats[i]))
        offset[r] += feats[i]
    return {
        "pixel_values": pixel_values,
        "image_grid_thw": grids[mine] if mine else grids[:0],
        "vision_gather_index": torch.cat(index),
        "vision_gather_width": width,
        "vision_images": mine,  # which of the batch's images this rank encodes
    }


def sequence_pad_multiple(cfg) -> int:
    """Every packed sample is padded to a multiple of this: context parallelism cuts each sample
    into 2*cp chunks, and sequence parallelism splits each rank's tokens over tp."""
    p = cfg.parallel
    need = (2 * p.cp if p.cp > 1 else 1) * (p.tp if p.sequence_parallel and p.tp > 1 else 1)
    return math.lcm(need, cfg.data.loader.pad_multiple or 1)
