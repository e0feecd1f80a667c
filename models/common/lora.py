"""LoRA adapters on megatron's linear layers: y = base(x) + (alpha / rank) * B(A(dropout(x))).

The adapter lives on the base layer itself (``lora_A`` [rank, in], ``lora_B`` [out, rank] beside
``weight``) and adds its term through a forward hook, so the base layer's forward, its
checkpoint keys and every path that reads ``weight`` stay as they were; the adapter weights
join the layer's ``state_dict`` and ``sharded_state_dict`` on their own.

Tensor parallelism: the adapter splits the way its base layer does.

- Column-parallel layer (output split: linear_qkv, GDN in_proj, linear_fc1): A is replicated
  [rank, in], B holds this rank's output rows [out / tp, rank], the same rows as the base
  weight's shard (the fused qkv groups, the [gate | up] halves of fc1, the GDN in_proj sections
  all stay aligned: the adapter's output adds to the base output element for element). The
  r-wide A(x) is gathered along the sequence under sequence parallelism (the base layer gathers
  its input the same way) and its gradient summed over TP (a partial B^T dy on every rank).
- Row-parallel layer (input split: linear_proj, GDN out_proj, linear_fc2): A holds this rank's
  input columns [rank, in / tp], B is replicated [out, rank]; the partial A(x) is summed over TP
  (all-reduce, or reduce-scatter along the sequence under sequence parallelism, as the base
  layer reduces its output) before B.

The split matrix carries megatron's ``tensor_model_parallel`` attributes (counted once per rank
in the gradient norm); a replicated one whose gradient is partial under sequence parallelism
(A of a column layer, B of a row layer: each rank saw its part of the sequence) carries
``sequence_parallel`` so megatron's finalize_model_grads sums it over TP like a norm weight.
Without sequence parallelism their gradients are already identical on every TP rank.

Checkpoints: ``shard_adapters`` gives the split matrix the sharding of its base weight in the
layer's sharded state dict (including the factories that split fc1 into gate / up and the GDN
in_proj into its sections), so the stored tensor is the full, layout-independent matrix: a TP=2
checkpoint loads at TP=1 (export, --merge-lora, --adapter-only) and vice versa.

Initialisation: A is kaiming-uniform (a=sqrt(5)) over the full [rank, in] matrix, drawn from a
generator seeded by (seed, the layer's global name), so every TP / PP layout starts from the same
adapters and the replicated A is identical on every TP rank; B is zero: the adapter's term is
exactly zero at step 0, so the first forward equals the base model's.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import torch
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from torch import nn

from models.common.frozen_linear import as_2d, fold_frozen_linear_inputs


def _tp_size(linear: nn.Module) -> int:
    group = getattr(linear, "tp_group", None)
    return group.size() if group is not None else 1


def _tp_rank(linear: nn.Module) -> int:
    group = getattr(linear, "tp_group", None)
    return group.rank() if group is not None else 0


def full_a(rank: int, in_features: int, name: str, seed: int) -> torch.Tensor:
    """The full A [rank, in_features] of the layer called ``name`` (its global module name):
    kaiming-uniform (a=sqrt(5)) from a generator seeded by (seed, name), the same on every rank
    and in every parallel layout."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()) + (seed << 32) % 2**62)
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_ with a=sqrt(5): gain * sqrt(3 / fan_in)
    return torch.empty(rank, in_features).uniform_(-bound, bound, generator=gen)


def add_adapter(linear: nn.Module, rank: int, alpha: float, dropout: float, name: str, seed: int) -> None:
    """Give ``linear`` (a megatron Column/RowParallelLinear, any TP) a LoRA adapter; ``name`` is
    its global module name (the same under every layout), ``seed`` seeds A."""
    if hasattr(linear, "lora_A"):
        raise ValueError("this layer already has a LoRA adapter")
    weight = linear.weight
    tp, tp_rank = _tp_size(linear), _tp_rank(linear)
    if isinstance(linear, RowParallelLinear):
        if not linear.input_is_parallel or linear.explicit_expert_comm:
            raise ValueError("LoRA on a RowParallelLinear needs input_is_parallel=True and no expert communication")
        split = "in"
        out_local, in_full = linear.output_size, linear.input_size
    elif isinstance(linear, ColumnParallelLinear):
        if linear.gather_output or linear.explicit_expert_comm or getattr(linear, "disable_grad_reduce", False):
            raise ValueError("LoRA on a ColumnParallelLinear needs gather_output=False, no expert communication "
                             "and its gradient reduction")
        split = "out"
        out_local, in_full = linear.output_size_per_partition, linear.input_size
    else:
        raise TypeError(f"LoRA needs a megatron Column/RowParallelLinear, got {type(linear).__name__}")
    a = full_a(rank, in_full, name, seed)
    if split == "in":
        width = in_full // tp
        a = a[:, tp_rank * width:(tp_rank + 1) * width]
    assert a.shape[1] == weight.shape[1] and out_local == weight.shape[0], (a.shape, weight.shape)
    linear.lora_A = nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
    linear.lora_B = nn.Parameter(torch.zeros(out_local, rank, dtype=weight.dtype, device=weight.device))
    linear.lora_scale = alpha / rank
    linear.lora_split = split
    linear.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    split_param, replicated = (linear.lora_B, linear.lora_A) if split == "out" else (linear.lora_A, linear.lora_B)
    split_param.lora_sharded_like_weight = True  # shard_adapters: stored with the base weight's sharding
    if tp > 1:
        set_tensor_model_parallel_attributes(split_param, True, 0 if split == "out" else 1, 1)
        # sequence parallelism: each rank's gradient of the replicated matrix covers its part of the sequence
        replicated.sequence_parallel = bool(linear.sequence_parallel)
    linear.register_forward_hook(_add_lora_term, with_kwargs=True)
    fold_frozen_linear_inputs()  # its base weight is frozen


def _dropout(linear: nn.Module, x: torch.Tensor, split_input: bool) -> torch.Tensor:
    if isinstance(linear.lora_dropout, nn.Identity) or not split_input:
        return linear.lora_dropout(x)  # a replicated input: the default stream, the same on every TP rank
    with tensor_parallel.get_cuda_rng_tracker().fork():  # this rank's slice: its own stream
        return linear.lora_dropout(x)


def _add_lora_term(linear: nn.Module, args: tuple, kwargs: dict, output):
    x = args[0] if args else kwargs["input_"]
    tp = _tp_size(linear)
    sp = tp > 1 and linear.sequence_parallel
    group = getattr(linear, "tp_group", None)
    # the adapter's GEMMs on [tokens, features] (models/common/frozen_linear.py: a 3-D input with
    # a size-1 batch dimension may otherwise run as a batched product of one-row GEMMs)
    x2 = as_2d(x)
    if linear.lora_split == "out":  # column parallel: x is the full input (its sequence slice under SP)
        u = nn.functional.linear(_dropout(linear, x2, sp), linear.lora_A)
        if sp:
            u = gather_from_sequence_parallel_region(u, group=group)  # backward: reduce-scatter of B^T dy
        elif tp > 1:
            u = copy_to_tensor_model_parallel_region(u, group=group)  # backward: all-reduce of B^T dy
    else:  # row parallel: x is this rank's input columns; the partial A x is reduced as the base output is
        u = nn.functional.linear(_dropout(linear, x2, tp > 1), linear.lora_A)
        if sp:
            u = reduce_scatter_to_sequence_parallel_region(u, group=group)
        elif tp > 1:
            u = reduce_from_tensor_model_parallel_region(u, group=group)
    base = output[0] if isinstance(output, tuple) else output  # megatron's linears return (output, bias)
    delta = linear.lora_scale * nn.functional.linear(u, linear.lora_B)
    summed = base + delta.view(base.shape).to(base.dtype)
    return (summed, *output[1:]) if isinstance(output, tuple) else summed


def is_adapter_param(name: str) -> bool:
    """Whether ``name`` (from ``named_parameters`` / ``state_dict``) is a LoRA adapter weight."""
    return name.endswith(".lora_A") or name.endswith(".lora_B")


# ----------------------------------------------------------------------------- checkpoints


def _mirror(weight: ShardedTensor, key: str, data: torch.Tensor) -> ShardedTensor:
    """``weight``'s sharding for ``data``: the dimensions ``data`` shares with the weight's shard
    keep its global size and offset; the others (the rank dimension) are whole."""
    assert weight.flattened_range is None, "LoRA adapters: flattened checkpoint shards are not supported"
    p = weight.prepend_axis_num
    global_shape = list(weight.global_shape)
    for d, (old, new) in enumerate(zip(weight.local_shape, data.shape)):
        if old != new:
            assert weight.axis_fragmentations[p + d] == 1 and weight.global_offset[p + d] == 0, (key, weight)
            global_shape[p + d] = new
    return dataclasses.replace(weight, key=key, data=data, dtype=data.dtype, local_shape=tuple(data.shape),
                               global_shape=tuple(global_shape))


def _mirror_factory(weight: ShardedTensorFactory, key: str, data: torch.Tensor) -> ShardedTensorFactory:
    """A factory that splits an adapter's rows exactly as ``weight`` (fc1's gate / up, the GDN
    in_proj sections) splits the base weight's rows: the weight's own builder says which rows go
    to which stored tensor at which global offset; the adapter's rows follow."""
    base = weight.data

    def build(k, t, replica_id, flattened_range):
        assert flattened_range is None, "LoRA adapters: flattened checkpoint shards are not supported"
        chunks = weight.build_fn(k, base, replica_id, None)
        assert isinstance(chunks, list), type(chunks)
        out, row = [], 0
        for c in chunks:
            n = c.local_shape[0]
            assert c.local_shape[1:] == tuple(base.shape[1:]), (k, c)
            out.append(_mirror(c, c.key, t[row:row + n]))
            row += n
        assert row == t.shape[0], (k, row, t.shape)
        return out

    return ShardedTensorFactory(key, data, build, weight.merge_fn, weight.replica_id)


def shard_adapters(sharded: dict) -> dict:
    """``sharded`` (a layer's sharded state dict) with the split adapter matrix of every layer (B of
    a column-parallel layer, A of a row-parallel one; megatron made it a replicated tensor) sharded
    like its base weight, at every TP size (TP=1 included, so the stored keys do not depend on the
    layout); the replicated matrices stay as they are."""
    for k, entry in list(sharded.items()):
        if not is_adapter_param(k) or not getattr(entry.data, "lora_sharded_like_weight", False):
            continue
        weight = sharded[k.rsplit(".", 1)[0] + ".weight"]
        if isinstance(weight, ShardedTensorFactory):
            sharded[k] = _mirror_factory(weight, entry.key, entry.data)
        else:
            sharded[k] = _mirror(weight, entry.key, entry.data)
    return sharded


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
