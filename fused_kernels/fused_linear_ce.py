"""Fused linear cross-entropy: per-token LM loss without materialising [tokens, vocab] logits.

With Qwen3.5's 248,320-token vocabulary the unfused loss path dominates activation memory:
the output layer writes bf16 logits [N, V] (4 GiB at 8K tokens), megatron's
``vocab_parallel_cross_entropy`` upcasts them to fp32 and keeps the fp32 softmax for
backward (8 GiB), and backward produces another [N, V] gradient. All of it scales with
sequence length. Here the logits only ever exist one chunk at a time.

Design (chosen to minimise peak memory, not to save the last matmul):

* Forward, chunked over tokens: ``logits = h_c @ W^T`` (bf16 inputs, fp32 accumulation in the
  GEMM, exactly what the unfused output layer does), upcast to fp32, per-token logsumexp
  and target logit. Only ``lse`` [N] (fp32) is kept for backward, plus ``h`` and ``W``,
  which the unfused output layer saves anyway.
* Backward, chunked over the vocabulary: recompute ``logits[:, v0:v1]`` for all tokens,
  ``p = exp(logits - lse) - onehot``, scale each row by its upstream gradient, then
  ``dW[v0:v1] = p^T @ h`` (one GEMM over all tokens: a single rounding, written straight into
  the gradient, no [V, H] fp32 accumulator) and ``dh += p @ W[v0:v1]`` (fp32 accumulator of
  only [N, H]: 64 MiB at 8K x 2048).

Why recompute rather than computing the gradients during forward (Liger's choice): the
loss is returned *per token* and masked/weighted downstream (``multimodal/loss.py``), so the
upstream gradient differs per token. ``dh`` could be rescaled row by row afterwards, but
``dW = sum_i g_i (p_i - y_i)^T h_i`` cannot; precomputing it would need the mask inside the
loss. Precomputing would also hold a [V, H] gradient (1-2 GiB for 248K x 2048) from the
loss forward until backward, which under pipeline schedules is several micro-batches
later. Recompute costs one extra [N, H] x [H, V] GEMM (a third more LM-head FLOPs, ~2-3% of
a Qwen3.5-2B step) and keeps the peak at one chunk plus the gradients themselves.

Tensor parallelism (vocab-parallel, like megatron's ``vocab_parallel_cross_entropy``): each
rank holds rows ``[vocab_start, vocab_start + V_local)`` of W. The per-token statistics are
combined across the TP group with three all-reduces over [N] vectors for the *whole* batch
(not per chunk): max of the local logsumexp, sum of ``exp(lse_local - max)``, and the target
logit (non-zero only on the rank owning the label). Backward needs no communication inside
the function; the partial ``dh`` of each rank is summed by the caller's region ops
(``copy_to_tensor_model_parallel_region`` / the sequence-parallel all-gather's backward
reduce-scatter), exactly as for megatron's ColumnParallelLinear output layer.

``weight_grad`` (set by models/performance/wgrad_fusion.py with ``model.grad_accum_fusion``):
"main_grad" adds each ``dW`` slice into ``weight.main_grad`` inside its GEMM (fp32
accumulation, no [V, H] bf16 gradient) and hands autograd the usual placeholder;
"main_grad_only" does the same and hands autograd nothing, for a weight tied to an embedding
whose own backward returns the placeholder (so no two [V, H] tensors are summed).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fused_kernels import ce_triton
from fused_kernels.triton_support import unavailable_reason
from fused_kernels import wgrad_accum


def _use_triton(x: torch.Tensor) -> bool:
    """The one-pass Triton kernels (fused_kernels/ce_triton.py) on GPU; PyTorch elsewhere. A GPU tensor
    they cannot take falls back with one warning per reason."""
    reason = unavailable_reason(x)
    if reason is not None and x.is_cuda:
        _warn_fallback(reason)
    return reason is None


@functools.cache
def _warn_fallback(reason: str) -> None:
    logging.getLogger(__name__).warning(
        "fused linear CE: the one-pass Triton kernels cannot run (%s); the loss path uses PyTorch ops "
        "(several passes over the logits instead of one)", reason)

# Elements of one fp32 logits chunk (the working set is ~8 bytes per element with the
# bf16 GEMM output and the bf16 copy of the gradient): 2**27 -> ~1 GiB peak per chunk.
DEFAULT_CHUNK_ELEMENTS = 2**27


def _chunk(total: int, other: int, requested: int | None, budget: int) -> int:
    if requested is not None:
        if requested < 1:
            raise ValueError(f"chunk size must be >= 1, got {requested}")
        return requested
    return max(1, min(total, budget // max(other, 1)))


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_start, token_chunk, vocab_chunk, group, ignore_index,
                weight_grad):
        n, vocab_local = hidden.shape[0], weight.shape[0]
        local = labels - vocab_start
        in_shard = (local >= 0) & (local < vocab_local)
        safe = torch.where(in_shard, local, torch.zeros_like(local))
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        target = torch.empty(n, dtype=torch.float32, device=hidden.device)
        step = _chunk(n, vocab_local, token_chunk, DEFAULT_CHUNK_ELEMENTS)
        kernel = _use_triton(hidden)
        for s in range(0, n, step):
            e = min(s + step, n)
            logits = hidden[s:e] @ weight.t()  # the GEMM's output dtype, as the output layer's
            if kernel:
                ce_triton.row_lse_and_target(logits, safe[s:e], lse[s:e], target[s:e])
            else:
                logits = logits.float()
                target[s:e] = logits.gather(1, safe[s:e, None]).squeeze(1)
                lse[s:e] = torch.logsumexp(logits, dim=-1)
            del logits
        target.mul_(in_shard)
        if group is not None and dist.get_world_size(group) > 1:
            # exact logsumexp over ranks: lse = m + log(sum_r exp(lse_r - m)), m = max_r lse_r
            m = lse.clone()
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            lse.sub_(m).exp_()
            dist.all_reduce(lse, group=group)
            lse.log_().add_(m)
            dist.all_reduce(target, group=group)
        keep = labels != ignore_index
        loss = (lse - target) * keep
        ctx.save_for_backward(hidden, weight, safe, in_shard, keep, lse)
        ctx.vocab_chunk = vocab_chunk
        ctx.weight_grad = weight_grad
        ctx.weight = weight if weight_grad != "autograd" else None  # the Parameter, for its main_grad
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, safe, in_shard, keep, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return (None,) * 9
        n, vocab_local = hidden.shape[0], weight.shape[0]
        g = (grad_loss.float() * keep)[:, None]
        kernel = _use_triton(hidden)
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        to_main_grad = need_w and ctx.weight_grad != "autograd"
        grad_w = torch.empty_like(weight) if need_w and not to_main_grad else None
        step = _chunk(vocab_local, n, ctx.vocab_chunk, DEFAULT_CHUNK_ELEMENTS)
        for v0 in range(0, vocab_local, step):
            v1 = min(v0 + step, vocab_local)
            w = weight[v0:v1]
            hit = in_shard & (safe >= v0) & (safe < v1)
            if kernel:  # one pass, in place on the GEMM output; col -1: label in another slice
                p = ce_triton.softmax_grad_(hidden @ w.t(), lse, g[:, 0], torch.where(hit, safe - v0, -1))
            else:
                p = (hidden @ w.t()).float()
                p.sub_(lse[:, None]).exp_()
                # subtract the one-hot of labels inside this slice with a scatter, free of host
                # syncs (no nonzero()): rows whose label lies elsewhere subtract 0
                col = (safe - v0).clamp_(0, v1 - v0 - 1)
                p.scatter_add_(1, col[:, None], -hit.to(p.dtype)[:, None])
                p.mul_(g)
                p = p.to(weight.dtype)
            if to_main_grad:
                wgrad_accum.accumulate_wgrad(hidden, p, ctx.weight.main_grad[v0:v1])
            elif need_w:
                torch.mm(p.t(), hidden, out=grad_w[v0:v1])
            if need_h:
                grad_h += p @ w
            del p
        if need_h:
            grad_h = grad_h.to(hidden.dtype)
        if to_main_grad and ctx.weight_grad == "main_grad":
            grad_w = wgrad_accum.added_to_main_grad(ctx.weight)
        return grad_h, grad_w, None, None, None, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                               tp_group=None, vocab_start: int | None = None, token_chunk: int | None = None,
                               vocab_chunk: int | None = None, ignore_index: int = -100,
                               weight_grad: str = "autograd") -> torch.Tensor:
    """Per-token cross-entropy of ``hidden @ weight^T`` against ``labels``, fp32, shape of ``labels``.

    hidden [..., H], labels [...] (same leading shape), weight [V_local, H] (this rank's vocab
    rows; ``vocab_start`` defaults to ``tp_rank * V_local``). ``token_chunk`` / ``vocab_chunk``
    override the forward / backward chunk sizes (default: ~2**27 logits per chunk). Labels
    equal to ``ignore_index`` give loss 0 and no gradient. The caller handles TP regions for
    ``hidden`` (see ``vocab_parallel_linear_cross_entropy``). ``weight_grad``: "autograd"
    (default), or "main_grad" / "main_grad_only" (module doc).
    """
    if weight_grad not in ("autograd", "main_grad", "main_grad_only"):
        raise ValueError(f"weight_grad must be autograd, main_grad or main_grad_only, got {weight_grad!r}")
    if weight_grad != "autograd" and not hasattr(weight, "main_grad"):
        raise ValueError(f"weight_grad={weight_grad} needs a weight with main_grad (wrap the model in DDP first)")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree")
    if weight.shape[-1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden.shape[-1]}")
    if vocab_start is None:
        rank = dist.get_rank(tp_group) if tp_group is not None and dist.get_world_size(tp_group) > 1 else 0
        vocab_start = rank * weight.shape[0]
    h2 = hidden.reshape(-1, hidden.shape[-1])
    if not h2.is_contiguous():
        h2 = h2.contiguous()
    loss = _FusedLinearCE.apply(h2, weight, labels.reshape(-1), vocab_start, token_chunk, vocab_chunk,
                                tp_group, ignore_index, weight_grad)
    return loss.view(labels.shape)


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   ignore_index: int = -100) -> torch.Tensor:
    """Plain PyTorch: full logits (in the weight's dtype, like the output layer) + F.cross_entropy
    in fp32. Single device, full vocabulary."""
    logits = hidden @ weight.t()
    loss = F.cross_entropy(logits.float().reshape(-1, weight.shape[0]), labels.reshape(-1),
                           reduction="none", ignore_index=ignore_index)
    return loss.view(labels.shape)


def vocab_parallel_linear_cross_entropy(hidden_sbh: torch.Tensor, weight: torch.Tensor, labels_bs: torch.Tensor,
                                        tp_group=None, sequence_parallel: bool = False,
                                        token_index: torch.Tensor | None = None, **kw) -> torch.Tensor:
    """The GPTModel post-process with the fused loss: decoder output [S(/TP), B, H] and labels
    [B, S] -> per-token loss [B, S], matching megatron's output layer + vocab-parallel CE.

    Under sequence parallelism the hidden states are all-gathered along the sequence (backward:
    reduce-scatter of the partial dh); otherwise they enter the TP region with an identity
    whose backward all-reduces dh, as ColumnParallelLinear does.

    ``token_index`` (flat s * B + b indices into the gathered [S, B]; same on every TP rank):
    compute the loss only there; every other token gets loss 0 and no gradient. Exact when
    those are the only tokens the caller's loss mask keeps (``model.sparse_lm_head``).
    """
    from megatron.core.tensor_parallel import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    tp = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    if sequence_parallel and tp > 1:
        hidden_sbh = gather_from_sequence_parallel_region(hidden_sbh, tensor_parallel_output_grad=True,
                                                          group=tp_group)
    elif tp > 1:
        hidden_sbh = copy_to_tensor_model_parallel_region(hidden_sbh, group=tp_group)
    labels_sb = labels_bs.transpose(0, 1)
    group = tp_group if tp > 1 else None
    if token_index is None:
        loss = fused_linear_cross_entropy(hidden_sbh, weight, labels_sb, tp_group=group, **kw)
        return loss.transpose(0, 1).contiguous()
    s, b, h = hidden_sbh.shape
    picked = hidden_sbh.reshape(s * b, h).index_select(0, token_index)
    picked_loss = fused_linear_cross_entropy(picked, weight, labels_sb.reshape(s * b).index_select(0, token_index),
                                             tp_group=group, **kw)
    loss = picked_loss.new_zeros(s * b).index_copy(0, token_index, picked_loss)
    return loss.view(s, b).transpose(0, 1).contiguous()
