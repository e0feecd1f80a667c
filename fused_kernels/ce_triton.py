"""Triton kernels for the elementwise half of the fused linear cross-entropy
(``fused_kernels/fused_linear_ce.py``); the GEMMs stay in cuBLAS.

Per chunk of logits (the bf16 output of the LM-head GEMM), PyTorch needed an fp32 copy and
five or six more passes over it: forward ``.float()``, ``logsumexp`` (max, subtract, exp,
sum); backward ``.float()``, subtract, exp, one-hot, scale, cast back. With a 248K
vocabulary the logits are the largest tensor of the step, so each extra pass over them is a
visible share of it (docs/kernels.md). Here each direction is one pass:

- ``row_lse_and_target``: one program per token row streams the row once, keeping a running
  max and rescaled sum (online logsumexp) in fp32, and reads the target logit;
- ``softmax_grad_``: rewrites the logits chunk in place with ``g * (exp(x - lse) - onehot)``.

Same fp32 math as the PyTorch ops in ``fused_linear_ce`` they replace, which stay the
reference and the fallback (tests compare both under the Triton interpreter); whether these
kernels can run is ``triton_support.unavailable_reason``, as for the other fused kernels. Token and vocabulary
counts are not specialised on: chunk shapes change with the batch.
"""

from __future__ import annotations

import torch

from fused_kernels.triton_support import interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch path runs
    triton = None

BLOCK = 1024 if interpreting() else 4096

if triton is not None:

    @triton.jit(do_not_specialize=["n_cols", "stride"])
    def _lse_target_kernel(x_ptr, stride, col_ptr, lse_ptr, target_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        offs = tl.arange(0, BLOCK)
        # the first block initialises the running max and sum (every block holds >= 1 column)
        x = tl.load(base + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        s = tl.sum(tl.exp(x - m), axis=0)
        for start in range(BLOCK, n_cols, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        tl.store(lse_ptr + row, m + tl.log(s))
        col = tl.load(col_ptr + row)
        tl.store(target_ptr + row, tl.load(base + col).to(tl.float32))

    @triton.jit(do_not_specialize=["n_cols", "stride"])
    def _softmax_grad_kernel(x_ptr, stride, lse_ptr, g_ptr, col_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        ptr = x_ptr + row * stride + cols
        x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - tl.load(lse_ptr + row)) - (cols == tl.load(col_ptr + row)).to(tl.float32)
        tl.store(ptr, (p * tl.load(g_ptr + row)).to(x_ptr.dtype.element_ty), mask=mask)


def row_lse_and_target(logits: torch.Tensor, col: torch.Tensor, lse_out: torch.Tensor,
                       target_out: torch.Tensor) -> None:
    """lse_out[i] = logsumexp(logits[i]) and target_out[i] = logits[i, col[i]], both fp32.
    ``logits`` [n, V] with unit column stride; ``col`` int64 in [0, V)."""
    n, v = logits.shape
    if n == 0:
        return
    assert logits.stride(1) == 1 and lse_out.is_contiguous() and target_out.is_contiguous()
    _lse_target_kernel[(n,)](logits, logits.stride(0), col, lse_out, target_out, v, BLOCK=BLOCK, num_warps=8)


def softmax_grad_(logits: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """In place: logits[i, j] = g[i] * (exp(logits[i, j] - lse[i]) - [j == col[i]]) in fp32, stored
    in the logits' dtype. ``col[i]`` outside [0, V) (label in another slice) subtracts nothing."""
    n, v = logits.shape
    if n == 0:
        return logits
    assert logits.stride(1) == 1
    _softmax_grad_kernel[(n, triton.cdiv(v, BLOCK))](logits, logits.stride(0), lse, g, col, v,
                                                     BLOCK=BLOCK, num_warps=8)
    return logits
