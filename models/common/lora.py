"""LoRA adapters on megatron's linear layers: y = base(x) + (alpha / rank) * B(A(dropout(x))).

The adapter lives on the base layer itself (``lora_A`` [rank, in], ``lora_B`` [out, rank] beside
``weight``) and adds its term through a forward hook, so the base layer's forward, its
checkpoint keys and every path that reads ``weight`` stay as they were; the adapter weights
join the layer's ``state_dict`` and ``sharded_state_dict`` (replicated tensors) on their own.

A is initialised like a linear layer's weight (kaiming-uniform, a=sqrt(5)), B is zero: the
adapter's term is exactly zero at step 0, so the first forward equals the base model's.

One tensor-parallel rank only (megatron's ColumnParallelLinear / RowParallelLinear with
TP = 1): under TP the input of a column-parallel layer would have to be gathered for A and a
row-parallel layer's partial A(x) reduced, which this module does not do (the config refuses it).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def add_adapter(linear: nn.Module, rank: int, alpha: float, dropout: float) -> None:
    """Give ``linear`` (a megatron Column/RowParallelLinear at TP = 1) a LoRA adapter."""
    if hasattr(linear, "lora_A"):
        raise ValueError("this layer already has a LoRA adapter")
    weight = linear.weight
    out_features, in_features = weight.shape
    a = torch.empty(rank, in_features, dtype=weight.dtype, device=weight.device)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5))
    linear.lora_A = nn.Parameter(a)
    linear.lora_B = nn.Parameter(torch.zeros(out_features, rank, dtype=weight.dtype, device=weight.device))
    linear.lora_scale = alpha / rank
    linear.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    linear.register_forward_hook(_add_lora_term, with_kwargs=True)


def _add_lora_term(linear: nn.Module, args: tuple, kwargs: dict, output):
    x = args[0] if args else kwargs["input_"]
    delta = linear.lora_scale * nn.functional.linear(
        nn.functional.linear(linear.lora_dropout(x), linear.lora_A), linear.lora_B)
    if isinstance(output, tuple):  # megatron's linears return (output, bias)
        return (output[0] + delta.to(output[0].dtype), *output[1:])
    return output + delta.to(output.dtype)


def is_adapter_param(name: str) -> bool:
    """Whether ``name`` (from ``named_parameters`` / ``state_dict``) is a LoRA adapter weight."""
    return name.endswith(".lora_A") or name.endswith(".lora_B")


@torch.no_grad()
def merged_state_dict(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """``state`` with every adapter folded into its base weight (W + scale * B @ A, computed in
    fp32) and the adapter entries removed: a plain base-model state dict."""
    out = {k: v for k, v in state.items() if not is_adapter_param(k)}
    for k in state:
        if k.endswith(".lora_A"):
            base = k[: -len("lora_A")]
            a, b = state[k].float(), state[base + "lora_B"].float()
            w = out[base + "weight"]
            out[base + "weight"] = (w.float() + scale * (b @ a)).to(w.dtype)
    return out
