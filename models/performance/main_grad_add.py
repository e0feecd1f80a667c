"""``main_grad += grad`` for many small parameters in two kernels instead of one each.

Why: a decoder layer's backward graph adds ~18 small parameter gradients (norm weights, conv
taps, A_log, dt_bias, biases) into their fp32 ``main_grad``; each add is its own kernel of a few
microseconds, launch- and tail-bound, and there are hundreds of them per step. DDP keeps every
``main_grad`` as a view of one flat buffer, and a layer's parameters sit next to each other
there, so the small gradients are concatenated (one kernel) and added to the span of the buffer
they cover (one kernel). The sums are the same fp32 additions as one add
per parameter, bit for bit.

Gaps between neighbours up to ``MAX_GAP`` elements (megatron pads parameter starts when the
distributed optimizer is on) are filled with zeros in the concatenation: adding 0 leaves them
as they were, and the whole span is written on the caller's stream, in order with the other
writes of that backward. Large gradients keep their own add: copying them first would only add
memory traffic to a bandwidth-bound add.
"""

from __future__ import annotations

import torch

from fused_kernels import main_grad_accumulate

SMALL = 1 << 20  # elements; at or above this a gradient keeps its own add
MAX_GAP = 64  # elements of padding a run may bridge


def plan_runs(mains: list[torch.Tensor], grads: list[torch.Tensor], small: int = SMALL,
              max_gap: int = MAX_GAP) -> tuple[list[int], list[list[int]]]:
    """(indices added one by one, runs of indices added together). A run's main_grads are
    contiguous views of one storage in address order with gaps of at most ``max_gap`` elements,
    and their gradients share one dtype."""
    single, candidates = [], {}
    for i, (m, g) in enumerate(zip(mains, grads)):
        if m.numel() >= small or not m.is_contiguous() or m.numel() != g.numel():
            single.append(i)
            continue
        key = (m.untyped_storage().data_ptr(), m.dtype, g.dtype, m.device)
        candidates.setdefault(key, []).append(i)
    runs = []
    for idx in candidates.values():
        idx.sort(key=lambda i: mains[i].storage_offset())
        run = [idx[0]]
        for i in idx[1:]:
            prev = mains[run[-1]]
            gap = mains[i].storage_offset() - (prev.storage_offset() + prev.numel())
            if 0 <= gap <= max_gap:
                run.append(i)
            else:
                runs.append(run)
                run = [i]
        runs.append(run)
    single += [r[0] for r in runs if len(r) == 1]
    return sorted(single), [r for r in runs if len(r) > 1]


def add_into_main_grads(mains: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """``mains[i] += grads[i]`` for every i (fp32 main_grads, gradients of any float dtype)."""
    single, runs = plan_runs(mains, grads)
    for i in single:  # large ones: the vectorised fp32 += bf16 kernel (bit-identical to add_)
        main_grad_accumulate.accumulate_(mains[i], grads[i])
    for run in runs:
        first, last = mains[run[0]], mains[run[-1]]
        start = first.storage_offset()
        span_len = last.storage_offset() + last.numel() - start
        pieces, zero, end = [], None, start
        for i in run:
            gap = mains[i].storage_offset() - end
            if gap:
                if zero is None:
                    zero = grads[i].new_zeros(())
                pieces.append(zero.expand(gap))
            pieces.append(grads[i].reshape(-1))
            end = mains[i].storage_offset() + mains[i].numel()
        span = first.new_empty(0).set_(first.untyped_storage(), start, (span_len,), (1,))
        span.add_(torch.cat(pieces))
