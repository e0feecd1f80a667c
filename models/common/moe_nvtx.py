"""NVTX ranges around the MoE layer's phases, so an Nsight Systems profile shows where the
shared expert, the dispatch all-to-all, the routed experts and the combine all-to-all run (and,
with ``parallel.moe_a2a_overlap``, what each all-to-all hides behind).

megatron-core 0.19.2 marks none of these itself inside the MoE layer; its combined-1F1B schedule
nodes push ranges ("moe_dispatch forward", ...) only after ``configure_nvtx_profiling(True)``,
and only in the overlapped schedule. Ours mark the MoELayer methods that both the plain forward
(``MoELayer.forward``) and the overlapped schedule (``fine_grained_callables``) call through the
instance, so the same names appear in both and a profile of the two can be compared.

Forward only: backward kernels are attributed to these ranges by Nsight's forward/backward
correlation. Installed on a GPU only; on a CPU the model is left untouched.
"""

from __future__ import annotations

import functools

import torch

# MoELayer method -> range name
PHASES = {
    "shared_experts_compute": "moe/shared_experts",
    "dispatch": "moe/dispatch",
    "routed_experts_compute": "moe/experts",
    "combine": "moe/combine",
}


def _ranged(fn, name: str):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        torch.cuda.nvtx.range_push(name)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.nvtx.range_pop()

    wrapped.nvtx_range = name
    return wrapped


def add_moe_nvtx_ranges(model: torch.nn.Module, enabled: bool | None = None) -> int:
    """Wrap the phases of every MoELayer in ``model`` in NVTX ranges (instance attributes: the
    class, parameters and state dict are untouched). ``enabled`` defaults to "CUDA is available".
    Idempotent. Returns the number of methods wrapped."""
    if enabled is None:
        enabled = torch.cuda.is_available()
    if not enabled:
        return 0
    from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: PLC0415

    count = 0
    for module in model.modules():
        if not isinstance(module, MoELayer):
            continue
        for method, name in PHASES.items():
            bound = getattr(module, method)
            if getattr(bound, "nvtx_range", None) is None:
                setattr(module, method, _ranged(bound, name))
                count += 1
    return count
