"""Weight-gradient accumulation fusion without Apex (``model.grad_accum_fusion``).

megatron-core's linear layers can add each weight gradient straight into the fp32
``main_grad`` buffer inside the backward GEMM (``gradient_accumulation_fusion``), but only
through Apex's ``fused_weight_gradient_mlp_cuda`` extension, which we do not ship. Without it
every linear's backward writes a bf16 weight gradient, and megatron's DDP hook then launches a
separate fp32 add into ``main_grad`` (on the 2B recipe: 528 adds, ~9 ms of GPU time and as
many host launches per step, docs/benchmarks/README.md).

torch's ``addmm`` with ``out_dtype=float32`` does the same GEMM as Apex's kernel: bf16 inputs,
fp32 accumulation, beta = 1 into the fp32 buffer. ``install()`` hands megatron a stand-in
module with Apex's two entry points built on it. The result differs from the unfused path
only in that the weight gradient is not rounded to bf16 before it is added (more exact).

Measured on the H200 (2B recipe, torch 2.11, docs/benchmarks/README.md, session 5) it is
slower, not faster: 0.377 s/step with it, 0.342 s without. So ``null`` leaves it off; it stays
available (``true``) for the exact fp32 accumulation and for other GPUs and torch releases.
"""

from __future__ import annotations

import functools
import types

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


@functools.cache
def unavailable_reason() -> str | None:
    """None if the fused path runs here, else why not. On CUDA it needs torch's
    ``addmm(out_dtype=...)``, checked once against the fp32 GEMM. The CPU (megatron patched by
    multimodal/platform.py) runs it with upcast inputs: correct, and used by the tests, but no
    faster, so ``null`` leaves it off there."""
    if not torch.cuda.is_available():
        return None
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(96, 48, device="cuda", generator=gen).to(torch.bfloat16)
        g = torch.randn(96, 32, device="cuda", generator=gen).to(torch.bfloat16)
        acc = torch.randn(32, 48, device="cuda", generator=gen)
        want = acc + g.float().t() @ x.float()
        wgrad_gemm_accum_fp32(x, g, acc)
        err = ((acc - want).abs().max() / want.abs().max()).item()
    except (RuntimeError, TypeError) as e:  # an older torch without addmm's out_dtype
        return f"torch {torch.__version__} cannot run addmm(out_dtype=float32) ({e})"
    if err > 1e-5:
        return f"addmm(out_dtype=float32) disagrees with the fp32 GEMM (max rel err {err:.1e})"
    return None


def resolve(requested: bool | None) -> bool:
    """model.grad_accum_fusion: null -> off (measured slower on the H200, see the module doc);
    true -> on, or a clear error."""
    reason = unavailable_reason()
    if requested is None:
        return False
    if requested and reason is not None:
        raise RuntimeError(f"model.grad_accum_fusion=true cannot run: {reason}; set it to null or false")
    return bool(requested)


def enable(model: torch.nn.Module) -> int:
    """Switch the fusion on in every megatron linear layer of ``model`` whose weight has a
    ``main_grad`` (set by megatron's DDP wrapper, which must come first: the fused backward
    writes there). Returns how many layers use it. Models built without DDP (conversion,
    parity scripts) keep the plain backward."""
    from megatron.core.tensor_parallel import layers

    layers.fused_weight_gradient_mlp_cuda = types.SimpleNamespace(
        wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32, wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16)
    layers._grad_accum_fusion_available = True
    count = 0
    for module in model.modules():
        if isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear)) and hasattr(
                getattr(module, "weight", None), "main_grad"):
            module.gradient_accumulation_fusion = True
            count += 1
    return count
