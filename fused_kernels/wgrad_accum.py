"""Weight-gradient GEMMs that add into megatron's fp32 ``main_grad`` in place, and the placeholder
a backward returns once it has done so.

The trainer's weight-gradient fusion (models/performance/wgrad_fusion.py, ``model.grad_accum_fusion``)
hands these to megatron's linear layers; the fused LM head (fused_kernels/fused_linear_ce.py) and the
CUDA graphs (models/performance/layer_graphs.py) call them directly, which is why they sit here,
below the model.
"""

from __future__ import annotations

import torch


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad [out, in] (fp32) += grad_output [T, out]^T @ total_input [T, in], in place."""
    if total_input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    elif main_grad.is_cuda:  # one cuBLAS GEMM: low-precision inputs, fp32 accumulate and output
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)
    else:  # no mixed-dtype GEMM on the CPU: upcast (the reference numerics)
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """The same for a bf16/fp16 main_grad (train without grad_reduce_in_fp32)."""
    main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


def accumulate_wgrad(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad += grad_output^T @ total_input, for an fp32 or a low-precision main_grad."""
    if main_grad.dtype == torch.float32:
        wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    else:
        wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)


def added_to_main_grad(weight: torch.Tensor) -> torch.Tensor:
    """What a backward returns for a weight whose gradient it already added into main_grad.

    megatron's DDP hook then skips its add (``grad_added_to_main_grad``) and drops the tensor.
    It must be a real tensor, not None: with ``overlap_grad_reduce`` the hook is what marks the
    weight ready for the all-reduce. ``empty`` is never written (megatron's linears return the
    same), and in the weight's own layout, so autograd takes it as the gradient without a copy.
    Zeros where megatron marked the weight ``zero_out_wgrad`` (a tied embedding whose lookup
    still returns a dense gradient): the hook then adds the sum, and the zeros add nothing."""
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):  # megatron's mark: the hook adds it (models/performance/wgrad_fusion.py _enable_vocabulary)
        return torch.zeros_like(weight)
    return torch.empty_like(weight)
