"""megatron DDP's gradient add, ``main_grad += param.grad`` (fp32 += bf16), through the vectorised
kernel of fused_kernels/main_grad_accumulate.py instead of torch's ``add_``.

Why: every weight whose gradient autograd leaves in ``param.grad`` (the linears and the vocabulary
weights when ``model.grad_accum_fusion`` is off, as in eager MoE steps; norms and small GDN
parameters always) is added into its fp32 ``main_grad`` by DDP's backward hook, once per
micro-batch. torch runs an fp32 += bf16 ``add_`` through its type-casting loop, well under the
copy bandwidth, a visible share of an eager MoE step (the 35B-A3B profile in docs/moe.md). The
kernel makes the same fp32 additions of the same upcast values, so the sums are bit-identical.

How: DDP builds one hook per parameter in ``_make_backward_post_hook`` while it is constructed;
under ``vectorised_grad_adds()`` each hook first makes the add itself and then runs megatron's
hook with ``grad_added_to_main_grad`` set for that call only, so megatron skips its own add, drops
``param.grad`` and marks the parameter ready for the gradient reduction exactly as before. Every
case megatron treats differently (a graph capture, a gradient already added by a fused backward,
``zero_out_wgrad``, a gradient the kernel cannot take) goes to megatron's hook unchanged.
"""

from __future__ import annotations

import contextlib

import torch

from fused_kernels import main_grad_accumulate


def _capturing() -> bool:
    from megatron.core.transformer.cuda_graphs import is_graph_capturing

    return is_graph_capturing() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _wrap(ddp, param: torch.nn.Parameter, hook):
    def add_then_hook(*unused):
        grad = param.grad
        if (grad is None or param not in ddp.param_to_bucket_group or param.grad_added_to_main_grad
                or getattr(param, "zero_out_wgrad", False) or _capturing()
                or main_grad_accumulate.available(param.main_grad, grad) is not None):
            return hook(*unused)
        main_grad_accumulate.accumulate_(param.main_grad, grad)
        param.grad_added_to_main_grad = True  # for megatron's hook: the add is done
        try:
            return hook(*unused)
        finally:
            param.grad_added_to_main_grad = False  # the next micro-batch's gradient is added again

    return add_then_hook


@contextlib.contextmanager
def vectorised_grad_adds():
    """DDP wrappers constructed inside add their gradients into main_grad with the kernel."""
    from megatron.core.distributed import DistributedDataParallel

    original = DistributedDataParallel._make_backward_post_hook

    def make(self, param):
        return _wrap(self, param, original(self, param))

    DistributedDataParallel._make_backward_post_hook = make
    try:
        yield
    finally:
        DistributedDataParallel._make_backward_post_hook = original
