"""Route megatron-core's fused SwiGLU (``bias_activation_fusion``) through fused_kernels/fused_swiglu.py.

megatron's MLP (the dense MLP, the shared expert, and each expert of the sequential MoE
experts) calls the module-level ``megatron.core.transformer.mlp.bias_swiglu_impl`` when
``bias_activation_fusion`` is on. That name is replaced, once per process, by ``_bias_swiglu``,
which takes the Triton kernels when they apply (no bias, no fp8 input store, no CPU offload of
the input, Triton on the input's device) and megatron's own compiled function otherwise, with a
warning naming the reason. Both compute the same expression in fp32 and round once.
"""

from __future__ import annotations

import functools
import logging

from fused_kernels import fused_swiglu

log = logging.getLogger(__name__)


@functools.cache
def _warn_fallback(reason: str) -> None:
    log.warning("Triton SwiGLU not used: %s; using megatron-core's compiled SwiGLU", reason)


def _reason(input, bias, fp8_input_store, cpu_offload_input) -> str | None:
    if bias is not None:
        return "fc1 has a bias"
    if fp8_input_store or cpu_offload_input:
        return "fp8 input store / CPU offload of the activation input"
    return fused_swiglu.available(input)


def route_swiglu_to_triton() -> None:
    import megatron.core.transformer.mlp as mlp  # noqa: PLC0415

    if getattr(mlp.bias_swiglu_impl, "triton_swiglu", False):
        return
    megatron_impl = mlp.bias_swiglu_impl

    def _bias_swiglu(input, bias, fp8_input_store=False, cpu_offload_input=False):
        reason = _reason(input, bias, fp8_input_store, cpu_offload_input)
        if reason is None:
            return fused_swiglu.swiglu(input)
        _warn_fallback(reason)
        return megatron_impl(input, bias, fp8_input_store, cpu_offload_input)

    _bias_swiglu.triton_swiglu = True
    _bias_swiglu.megatron_impl = megatron_impl
    mlp.bias_swiglu_impl = _bias_swiglu
