"""The collectives of context parallelism (CP) inside the model.

Mixers see the whole sequence through head-parallel all-to-all (Ulysses style): before the
mixer each rank sends head group h of its local tokens to rank h, so every rank holds *all*
tokens of ``heads/cp`` heads, restores the original token order and runs the ordinary
single-GPU kernels (varlen attention, the GDN conv + delta rule with ``cu_seqlens``); a
second all-to-all brings the outputs back to the local tokens. Per layer that is two
all-to-alls of the mixer's inputs/outputs and no host sync: the index tensors that reorder
tokens are built once per micro-batch on the host (multimodal/context_parallel.py) and ride on
``CPPackedSeqParams`` (models/common/packed_seq.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.common.packed_seq import CPPackedSeqParams


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
