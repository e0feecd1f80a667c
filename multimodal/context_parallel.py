"""Context parallelism (CP) for packed multimodal batches.

Layout (load balanced "zigzag"): every packed sample (every ``cu_seqlens_padded`` segment,
or every row of a BSHD batch) is cut into ``2*cp`` equal chunks and CP rank r keeps chunks
r and 2*cp-1-r, so each rank holds the same number of tokens of every sample and the causal
work is balanced. Tokens, labels, loss mask and MRoPE position ids are split the same way
on the host (``partition_batch``), before the batch goes to the device.

Mixers see the whole sequence through head-parallel all-to-all (Ulysses style): before the
mixer each rank sends head group h of its local tokens to rank h, so every rank holds *all*
tokens of ``heads/cp`` heads, restores the original token order and runs the ordinary
single-GPU kernels (varlen attention, the GDN conv + delta rule with ``cu_seqlens``); a
second all-to-all brings the outputs back to the local tokens. Per layer that is two
all-to-alls of the mixer's inputs/outputs and no host sync: the index tensors that reorder
tokens are built once per micro-batch on the host.

Everything the model needs rides on ``CPPackedSeqParams``, which megatron-core passes
through every layer untouched (so recompute and pipeline schedules see the right batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class PackedRowParams(PackedSeqParams):
    """megatron's PackedSeqParams plus per-micro-batch metadata built once on the host, so that no
    layer rebuilds it on the device (nor syncs to do so): the GDN layers' varlen table for fla
    (``kernels.gated_delta_rule.GDNVarlen``; None: the layers derive it themselves) and the
    loss tokens for the sparse LM head."""

    gdn_varlen: object | None = None
    # flat indices (s * B + b over this rank's [S, B] tokens) of the tokens with a nonzero loss
    # mask, for model.sparse_lm_head; None: the LM head runs on every token
    loss_token_index: torch.Tensor | None = None
    # True for the CUDA graphs' fixed-shape metadata (models/common/layer_graphs.StaticBatch):
    # cu_seqlens padded with empty segments, max_seqlen_q the row length (an upper bound)
    static_shape: bool = False

    def one_segment(self, tokens: int) -> bool:
        """Whether this row of ``tokens`` tokens is a single sample, known on the host: its longest
        segment is the whole row. Never for static-shape metadata, whose max_seqlen is a bound."""
        return not self.static_shape and self.max_seqlen_q == tokens


def segment_boundaries(params: PackedSeqParams) -> torch.Tensor:
    """The cumulative token offsets of a packed row's samples as the kernels must see them: the
    padded ones (each sample padded for CP or for the GDN chunk size) when given, else the real ones."""
    cu = params.cu_seqlens_q_padded
    return params.cu_seqlens_q if cu is None else cu


@dataclass
class CPPackedSeqParams(PackedRowParams):
    """PackedSeqParams plus what the head-parallel mixers need under context parallelism.

    ``cu_seqlens_*_padded`` and ``max_seqlen_*`` describe the *whole* (gathered) sequence.
    gather_order[j] is the global token index of the j-th row of the all-to-all output
    (rank 0's local tokens, then rank 1's, ...); restore_order is its inverse permutation.
    For BSHD batches ``qkv_format`` is "sbhd" and the orders apply to every row.
    """

    cp_size: int = 1
    cp_rank: int = 0
    cp_mixer_group: dist.ProcessGroup | None = None
    gather_order: torch.Tensor | None = None
    restore_order: torch.Tensor | None = None


def cp_info(packed_seq_params) -> CPPackedSeqParams | None:
    if isinstance(packed_seq_params, CPPackedSeqParams) and packed_seq_params.cp_size > 1:
        return packed_seq_params
    return None


# ---------------------------------------------------------------- host side: split a batch


def zigzag_indices(segments: list[int], cp: int, rank: int) -> torch.Tensor:
    """Global token indices rank ``rank`` keeps, in its local order, for consecutive segments."""
    parts, start = [], 0
    for length in segments:
        if length % (2 * cp):
            raise ValueError(
                f"a packed segment of {length} tokens cannot be split into 2*cp = {2 * cp} chunks; "
                f"the collate must pad every sample to a multiple of {2 * cp}"
            )
        chunk = length // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            parts.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
        start += length
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _segments(batch: dict) -> list[int]:
    cu = batch.get("cu_seqlens_padded")
    if cu is None:
        cu = batch.get("cu_seqlens")
    if cu is None:  # BSHD: every row is one segment
        return [batch["tokens"].shape[1]]
    cu = cu.tolist()
    return [e - s for s, e in zip(cu[:-1], cu[1:])]


def partition_batch(batch: dict, cp: int, rank: int, image_token_id: int, split_vision: bool = False,
                    merge: int = 2) -> dict:
    """This CP rank's share of a collated (host) micro-batch, plus the reorder metadata.

    Added keys: ``cp_gather_order``, ``cp_restore_order`` (see CPPackedSeqParams) and
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
    is_image = batch["tokens"] == image_token_id  # [B, S]
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
    all-gather padded to the busiest rank's row count (``VisionGather``)."""
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


# ---------------------------------------------------------------- device side: all-to-all


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all over dim 0 (size = group size); its gradient is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # empty_like keeps a view's strides; the collective writes row-major
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def tokens_to_heads(x: torch.Tensor, p: CPPackedSeqParams) -> torch.Tensor:
    """[S_local, B, cp, *rest] (the cp axis indexes head groups) -> [S_global, B, *rest]:
    all tokens, in original order, of this rank's head group."""
    cp = p.cp_size
    if x.shape[2] != cp:
        raise ValueError(f"expected the head-group axis (dim 2) to have cp={cp} entries, got {tuple(x.shape)}")
    s_local, batch = x.shape[:2]
    y = _AllToAll.apply(x.movedim(2, 0), p.cp_mixer_group)  # [cp (source rank), S_local, B, *rest]
    y = y.reshape(cp * s_local, batch, *x.shape[3:])
    return y.index_select(0, p.restore_order)


def heads_to_tokens(y: torch.Tensor, p: CPPackedSeqParams) -> torch.Tensor:
    """Inverse of tokens_to_heads: [S_global, B, *rest] -> [S_local, B, cp, *rest]."""
    cp = p.cp_size
    s_local = y.shape[0] // cp
    y = y.index_select(0, p.gather_order).reshape(cp, s_local, *y.shape[1:])
    x = _AllToAll.apply(y, p.cp_mixer_group)  # [cp (head group), S_local, B, *rest]
    return x.movedim(0, 2)


class VisionGather(torch.autograd.Function):
    """This rank's image features [n_own, H] -> the features of all images of the micro-batch, in
    batch order, on every CP rank. Forward: one all-gather, padded to the busiest rank. Backward:
    every rank's gradient for every image is summed (all-reduce) and each rank keeps its own
    images' rows, which is the gradient of its vision encoder's output."""

    @staticmethod
    def forward(ctx, own: torch.Tensor, index: torch.Tensor, width: int, group, rank: int) -> torch.Tensor:
        ctx.index, ctx.width, ctx.group, ctx.rank, ctx.n_own = index, width, group, rank, own.shape[0]
        padded = own.new_zeros(width, own.shape[1])
        padded[: own.shape[0]] = own
        parts = [torch.empty_like(padded) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat(parts).index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        full = grad.new_zeros(size * ctx.width, grad.shape[1]).index_add_(0, ctx.index, grad)
        dist.all_reduce(full, group=ctx.group)
        start = ctx.rank * ctx.width
        return full[start: start + ctx.n_own], None, None, None, None


def split_heads(x: torch.Tensor, cp: int) -> torch.Tensor:
    """[S, B, H, D] -> [S, B, cp, H/cp, D] (contiguous head groups, as tokens_to_heads wants)."""
    s, b, h = x.shape[:3]
    if h % cp:
        raise ValueError(f"{h} heads cannot be split over context-parallel size {cp}")
    return x.reshape(s, b, cp, h // cp, *x.shape[3:])


def gather_sequence(x: torch.Tensor, p: CPPackedSeqParams, dim: int = 1) -> torch.Tensor:
    """Per-token outputs of the local tokens (e.g. log-probs or losses [B, S_local]) -> the whole
    sequence [B, S_global] in original order, on every CP rank. One all-gather per call; for
    evaluation and RL (no gradient flows back through it)."""
    x = x.detach().movedim(dim, 0).contiguous()
    parts = [torch.empty_like(x) for _ in range(p.cp_size)]
    dist.all_gather(parts, x, group=p.cp_mixer_group)
    full = torch.cat(parts).index_select(0, p.restore_order.to(x.device))
    return full.movedim(0, dim)
