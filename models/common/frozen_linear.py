"""Frozen megatron linears as one 2-D GEMM, whatever the strides of a size-1 batch dimension.

A frozen weight (``model.freeze``, every base weight under ``model.lora``) sends megatron's
Column/RowParallelLinear through ``linear_with_frozen_weight``, whose forward is
``torch.matmul(input, weight.t())`` on the [S, B, H] input. For B = 1 (our packed rows) with a
non-matching stride on that size-1 dimension (a transposed [1, S, H] view, as the GDN in_proj
input is), torch before 2.12 does not fold the matmul into one ``mm``: it runs a ``bmm`` of S
one-row products, each reading the whole weight (pytorch/pytorch#186148). Under LoRA that
makes the GDN in_proj, a large frozen weight, dominate the step (``docs/finetuning.md``).

``fold_frozen_linear_inputs`` wraps that function once: the input's leading dimensions are
flattened (a view for these layouts) before the call and restored after, so the GEMM is an
``mm`` in every torch release. Sequence parallelism's gather along the first dimension gives the
same rows flattened or not (the sequence dimension is the outer one). ``as_2d`` does the same for
the LoRA adapters' own GEMMs.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.tensor_parallel import layers


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., H] as [N, H] (a view whenever the strides allow it, else a copy)."""
    return x.reshape(-1, x.shape[-1]) if x.dim() > 2 else x


def fold_frozen_linear_inputs() -> bool:
    """Route megatron's frozen-weight linears through a 2-D input; returns False when already done."""
    original = layers.linear_with_frozen_weight
    if getattr(original, "folds_input", False):
        return False

    @functools.wraps(original)
    def folded(input, weight, *args, **kwargs):
        if input.dim() <= 2:
            return original(input, weight, *args, **kwargs)
        out = original(as_2d(input), weight, *args, **kwargs)
        return out.view(-1, *input.shape[1:-1], out.shape[-1])

    folded.folds_input = True
    layers.linear_with_frozen_weight = folded
    return True
