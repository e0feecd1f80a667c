"""AdamW over flat buffers in one Triton kernel that also writes the bf16 model parameters.

torch's fused AdamW walks a list of per-parameter tensors (multi_tensor_apply: one launch per
few tensors' chunks), and megatron then copies every fp32 main parameter to its bf16 model
parameter (hundreds more launches, which read the 4-byte main parameters again). Both run below
the device's copy bandwidth and together are a visible share of the step (docs/kernels.md).
Here the fp32 main parameters, both moments and the bf16 model parameters live in flat buffers
laid out like megatron's gradient buffer, so one kernel per parameter group reads
param, grad, m, v once and writes param, m, v and the bf16 copy once (multimodal/performance/flat_adamw_patch.py
does the layout and the wiring into megatron's optimizer).

The work list is a table of chunks (start, state start, length), at most ``CHUNK`` elements each,
built once: padding between parameters (the gradient buffer aligns them) is not touched, and
groups with other hyper-parameters (no weight decay) get their own table. The gradient and the
output are read and written at ``start`` (the gradient buffer's index space); the parameters and
moments at ``state start``, which is the same index unless they hold only this rank's shard of
the buffer (megatron's distributed optimizer), packed densely.

Update (decoupled weight decay, as torch.optim.AdamW and its fused kernel):
    g = grad / grad_scale                      (grad_scale: optional device scalar, multimodal/performance/multi_tensor.py)
    p = p - lr * wd * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps),   bc_i = 1 - beta_i ** step
The bias corrections are computed on the host from the step count (a Python int), so the step
reads nothing back from the device.

``skip`` (optional one-element device tensor, torch's ``found_inf`` convention): where it is
nonzero the parameters, moments and output are left as they are (a step with a non-finite
gradient norm, multimodal/nonfinite.py); gradients are still zeroed when asked, so the next
step does not accumulate onto them. Decided on the device, so a skipped step costs no sync.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: the reference still works
    triton = None

BLOCK = 2048        # elements per inner iteration of a program
CHUNK = 8 * BLOCK   # elements per program: the unit of the work table


def chunk_table(segments, device, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(starts int64, state_starts int64, lengths int32) covering each segment with chunks of <=
    ``chunk`` elements. A segment is (start, numel), or (start, state_start, numel) when the
    parameters and moments are packed differently from the gradients and output (a data-parallel
    shard of the gradient buffer, multimodal/performance/flat_adamw_patch.py)."""
    starts, state_starts, lengths = [], [], []
    for seg in segments:
        start, state_start, numel = seg if len(seg) == 3 else (seg[0], seg[0], seg[1])
        for off in range(0, numel, chunk):
            starts.append(start + off)
            state_starts.append(state_start + off)
            lengths.append(min(chunk, numel - off))
    return (torch.tensor(starts, dtype=torch.int64, device=device),
            torch.tensor(state_starts, dtype=torch.int64, device=device),
            torch.tensor(lengths, dtype=torch.int32, device=device))


def _scalars(lr: float, beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """(step_size, sqrt(bias_correction2)) for the step about to be taken (``step`` counts from 1)."""
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    return lr / bc1, math.sqrt(bc2)


if triton is not None:

    @triton.jit
    def _flat_adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, starts_ptr, state_starts_ptr, lengths_ptr, scale_ptr,
                           skip_ptr, lr, wd, beta1, beta2, eps, step_size, bc2_sqrt,
                           HAS_SCALE: tl.constexpr, HAS_SKIP: tl.constexpr, WRITE_OUT: tl.constexpr,
                           ZERO_GRAD: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
        pid = tl.program_id(0)
        start = tl.load(starts_ptr + pid)  # gradient and output
        state_start = tl.load(state_starts_ptr + pid)  # parameter and moments
        n = tl.load(lengths_ptr + pid)
        if HAS_SCALE:
            grad_scale = tl.load(scale_ptr)
        if HAS_SKIP:
            skip = tl.load(skip_ptr)
        for off in tl.static_range(0, CHUNK, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            mask = idx < n
            if HAS_SKIP:  # a skipped step leaves p, m, v and the output as they are
                write = mask & (tl.zeros([BLOCK], dtype=tl.float32) + skip == 0.0)
            else:
                write = mask
            ptr = start + idx
            sp = state_start + idx
            p = tl.load(p_ptr + sp, mask=mask, other=0.0)
            g = tl.load(g_ptr + ptr, mask=mask, other=0.0).to(tl.float32)
            m = tl.load(m_ptr + sp, mask=mask, other=0.0)
            v = tl.load(v_ptr + sp, mask=mask, other=0.0)
            # IEEE sqrt and division (Triton's defaults are the approximate ones), to agree with
            # torch's kernel to the rounding of the products
            if HAS_SCALE:
                g = tl.div_rn(g, grad_scale)
            p = p - lr * wd * p
            m = beta1 * m + (1.0 - beta1) * g
            v = beta2 * v + (1.0 - beta2) * g * g
            denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
            p = p - tl.div_rn(step_size * m, denom)
            tl.store(p_ptr + sp, p, mask=write)
            tl.store(m_ptr + sp, m, mask=write)
            tl.store(v_ptr + sp, v, mask=write)
            if WRITE_OUT:
                tl.store(out_ptr + ptr, p.to(out_ptr.dtype.element_ty), mask=write)
            if ZERO_GRAD:  # the next step accumulates into it (replaces the separate zeroing pass)
                tl.store(g_ptr + ptr, tl.zeros([BLOCK], dtype=g_ptr.dtype.element_ty), mask=mask)


def flat_adamw_reference(param, grad, exp_avg, exp_avg_sq, out, starts, state_starts, lengths, *, lr,
                         weight_decay, beta1, beta2, eps, step, grad_scale=None, zero_grad=False, skip=None):
    """The same update in plain PyTorch, chunk by chunk (CPU tests and the kernel's check)."""
    step_size, bc2_sqrt = _scalars(lr, beta1, beta2, step)
    for start, state_start, n in zip(starts.tolist(), state_starts.tolist(), lengths.tolist()):
        sl, ss = slice(start, start + n), slice(state_start, state_start + n)
        p, m, v = param[ss], exp_avg[ss], exp_avg_sq[ss]
        g = grad[sl].float()
        if grad_scale is not None:
            g = g / grad_scale
        new_p = p - lr * weight_decay * p
        new_m = beta1 * m + (1.0 - beta1) * g
        new_v = beta2 * v + (1.0 - beta2) * g * g
        new_p = new_p - step_size * new_m / (new_v.sqrt() / bc2_sqrt + eps)
        new_out = new_p
        if skip is not None:  # chosen on the device, as the kernel does: no host read of the flag
            keep = skip.reshape(()) != 0
            new_p, new_m, new_v = (torch.where(keep, old, new) for old, new in ((p, new_p), (m, new_m), (v, new_v)))
            if out is not None:
                new_out = torch.where(keep, out[sl], new_p.to(out.dtype))
        p.copy_(new_p)
        m.copy_(new_m)
        v.copy_(new_v)
        if out is not None:
            out[sl].copy_(new_out)
        if zero_grad:
            grad[sl].zero_()


def flat_adamw(param, grad, exp_avg, exp_avg_sq, out, starts, state_starts, lengths, *, lr, weight_decay, beta1, beta2,
               eps, step, grad_scale=None, zero_grad: bool = False, skip=None, use_kernel: bool = True, block: int = BLOCK,
               chunk: int = CHUNK, num_warps: int = 8):
    """One AdamW step over the chunks of ``chunk_table``: the flat fp32 ``param``, ``exp_avg``,
    ``exp_avg_sq`` (updated in place, at ``state_starts``) with gradients ``grad`` (fp32 or bf16,
    flat, at ``starts``); writes the new parameters to ``out`` (flat, any float dtype, at
    ``starts``) unless it is None. ``grad_scale``:
    None or a one-element device tensor the gradients are divided by. ``zero_grad``: write zeros over
    the gradients read (multimodal/performance/overlap_update.py: the step then needs no separate zeroing pass,
    which would have to wait for it). ``step``: the step being
    taken, counting from 1. ``chunk`` must be the one the table was built with; ``block`` and
    ``num_warps`` are the launch shape (scripts/bench_adamw.py sweeps them)."""
    if not use_kernel:
        return flat_adamw_reference(param, grad, exp_avg, exp_avg_sq, out, starts, state_starts, lengths, lr=lr,
                                    weight_decay=weight_decay, beta1=beta1, beta2=beta2, eps=eps, step=step,
                                    grad_scale=grad_scale, zero_grad=zero_grad, skip=skip)
    for t in (param, exp_avg, exp_avg_sq):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError("flat_adamw: param, exp_avg and exp_avg_sq must be contiguous fp32 buffers")
    step_size, bc2_sqrt = _scalars(lr, beta1, beta2, step)
    if starts.numel() == 0:
        return
    _flat_adamw_kernel[(starts.numel(),)](
        param, grad, exp_avg, exp_avg_sq, out if out is not None else param, starts, state_starts, lengths,
        grad_scale if grad_scale is not None else param, skip if skip is not None else param,
        float(lr), float(weight_decay), float(beta1), float(beta2), float(eps), float(step_size), float(bc2_sqrt),
        HAS_SCALE=grad_scale is not None, HAS_SKIP=skip is not None, WRITE_OUT=out is not None, ZERO_GRAD=zero_grad, BLOCK=block, CHUNK=chunk, num_warps=num_warps)
