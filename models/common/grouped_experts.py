"""Routed experts as grouped GEMMs: every local expert of a layer in two weight tensors.

megatron-core 0.19 offers grouped experts only through Transformer Engine (``TEGroupedMLP``);
without it, ``SequentialMLP`` runs one MLP per expert from a Python loop and reads the token
counts on the host. ``GroupedExperts`` is a drop-in for either inside megatron's ``MoELayer``:

- weights ``linear_fc1.weight`` [E_local, 2F/etp, H] (rows [gate | up] of each expert, as
  megatron's GLU fc1) and ``linear_fc2.weight`` [E_local, H, F/etp];
- forward: ``fc1 = x @ W1[e]^T`` for each expert's rows, ``act = silu(gate) * up * prob`` (one
  Triton kernel per direction, fused_kernels/fused_swiglu.py), ``out = act @ W2[e]^T``; both GEMMs are
  one grouped GEMM each (fused_kernels/grouped_gemm.py) whose group offsets stay on the device;
  under ``train.fp8`` the same GEMMs with FP8 operands (models/common/fp8.py ``grouped_mm``);
- backward written out (``_ExpertMLP``): the same four grouped GEMMs autograd would run, so the
  ``moe_act`` recompute (keep fc1's output, regenerate ``act`` in backward) gives the same bits;
- checkpoints: ``sharded_state_dict`` writes the keys and global shapes SequentialMLP writes
  (``<prefix>experts.linear_fc1.weight`` of global shape [E, 2F, H], gate and up halves sharded
  separately under expert TP), so checkpoints move between the two and between any EP / ETP;
  a plain state dict in SequentialMLP's names (``local_experts.<i>.linear_fc1.weight``) loads.
"""

from __future__ import annotations

import functools
import logging
import re

import torch
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

from fused_kernels import fused_swiglu, main_grad_accumulate
from fused_kernels.grouped_gemm import grouped_mm
from fused_kernels.wgrad_accum import added_to_main_grad

log = logging.getLogger(__name__)


@functools.cache
def _warn_act_fallback(reason: str) -> None:
    log.warning("MoE experts: Triton weighted SwiGLU not used (%s); using the PyTorch reference", reason)


def _act_forward(fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    reason = fused_swiglu.available(fc1)
    if reason is None:
        return fused_swiglu.weighted_swiglu_forward(fc1, probs)
    _warn_act_fallback(reason)
    return fused_swiglu.weighted_swiglu_reference(fc1, probs)


def _act_backward(g: torch.Tensor, fc1: torch.Tensor, probs: torch.Tensor):
    if fused_swiglu.available(fc1) is None:
        return fused_swiglu.weighted_swiglu_backward(g, fc1, probs)
    return fused_swiglu.weighted_swiglu_back_reference(g, fc1, probs)


class _ExpertMLP(torch.autograd.Function):
    """fc1 -> weighted SwiGLU -> fc2 over groups of rows; ``recompute`` keeps fc1's output only."""

    @staticmethod
    def forward(ctx, x, w1, w2, probs, offs, recompute: bool, gemm, split_gemm):
        """``split_gemm``: the GEMM for the two products that contract over the expert FFN, which
        expert tensor parallelism splits (fc2's forward, fc1's input gradient); under FP8 it
        all-reduces their amax over the expert TP group, elsewhere it is ``gemm``."""
        fc1 = gemm(x, w1.mT, offs)  # [N, 2F]
        act = _act_forward(fc1, probs)  # [N, F]
        out = split_gemm(act, w2.mT, offs)  # [N, H]
        ctx.save_for_backward(x, w1, w2, probs, offs, fc1, None if recompute else act)
        ctx.gemm, ctx.split_gemm = gemm, split_gemm
        return out

    @staticmethod
    def backward(ctx, g):
        x, w1, w2, probs, offs, fc1, act = ctx.saved_tensors
        if act is None:  # moe_act recompute: the same kernel on the same input, same bits
            act = _act_forward(fc1, probs)
        g = g.contiguous()
        gemm = ctx.gemm
        d_act = gemm(g, w2, offs)  # [N, F]
        # frozen experts (model.freeze, LoRA): no weight gradient is computed at all
        dw2 = _into_main_grad(w2, gemm(g.mT, act, offs)) if ctx.needs_input_grad[2] else None  # [E, H, F]
        del act
        d_fc1, d_probs = _act_backward(d_act, fc1, probs)
        dx = ctx.split_gemm(d_fc1, w1, offs)  # [N, H]
        dw1 = _into_main_grad(w1, gemm(d_fc1.mT, x, offs)) if ctx.needs_input_grad[1] else None  # [E, 2F, H]
        return dx, dw1, dw2, d_probs, None, None, None, None


def _into_main_grad(weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Add an expert weight gradient into DDP's fp32 ``main_grad`` here, with one vectorised kernel
    (fused_kernels/main_grad_accumulate.py: torch's fp32 += bf16 add_ ran at ~40% of the bandwidth), and
    hand autograd the placeholder megatron's fused linear layers hand it (``added_to_main_grad``),
    so DDP's hook does not add it again. Without DDP (conversion, parity scripts) the gradient
    goes to ``.grad`` as usual."""
    main = getattr(weight, "main_grad", None)
    if main is None or not hasattr(weight, "grad_added_to_main_grad"):
        return grad
    main_grad_accumulate.accumulate_(main, grad)
    del grad  # its memory serves the placeholder
    return added_to_main_grad(weight)


class _Weight(torch.nn.Module):
    """Holds one stacked weight, so the state-dict names read ``linear_fc1.weight``."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)


_SEQUENTIAL_NAME = re.compile(r"local_experts\.(\d+)\.(linear_fc[12])\.(weight|_extra_state)$")


class GroupedExperts(MegatronModule):
    """All local experts of one MoE layer; the ``experts`` module megatron's MoELayer builds."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None, name=None):
        super().__init__(config=config)
        if config.moe_apply_probs_on_input or config.add_bias_linear or not config.gated_linear_unit:
            raise ValueError("GroupedExperts implements gated (SwiGLU) experts without bias that scale "
                             "by the router probability after the activation")
        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp
        self.recompute_act = False  # train.recompute_modules: [moe_act]
        # train.fp8: models/common/fp8.py sets its FP8 grouped GEMM here, used for all four GEMMs
        self.fp8_gemm = None
        etp = self.tp_group.size()
        f, h = config.moe_ffn_hidden_size, config.hidden_size
        if f % etp:
            raise ValueError(f"moe_ffn_hidden_size {f} is not divisible by the expert tensor-parallel size {etp}")
        f_local = f // etp
        on_cpu = config.use_cpu_initialization
        # on CPU: the default device, so a model built under ``torch.device("meta")`` (streaming
        # HF conversion) holds no expert memory
        device = None if on_cpu else torch.cuda.current_device()
        w1 = torch.empty(num_local_experts, 2 * f_local, h, dtype=config.params_dtype, device=device)
        w2 = torch.empty(num_local_experts, h, f_local, dtype=config.params_dtype, device=device)
        if config.perform_initialization:
            self._initialize(w1, config.init_method, on_cpu)
            self._initialize(w2, config.output_layer_init_method, on_cpu)
        self.linear_fc1 = _Weight(w1)
        self.linear_fc2 = _Weight(w2)
        expert_parallel = config.expert_model_parallel_size > 1
        for weight, dim in ((self.linear_fc1.weight, 1), (self.linear_fc2.weight, 2)):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)
            # megatron's DDP reduces params with allreduce=False over the expert-data-parallel group
            weight.allreduce = not expert_parallel
        self._register_load_state_dict_pre_hook(self._stack_sequential_names)

    def _initialize(self, weight: torch.Tensor, init_method, on_cpu: bool) -> None:
        """Each expert as megatron initialises one expert's linear layer: fp32, then cast."""
        with torch.no_grad():
            for e in range(weight.shape[0]):
                master = torch.empty(weight.shape[1:], dtype=torch.float32, device=weight.device)
                if on_cpu:
                    init_method(master)
                else:
                    tracker = tensor_parallel.get_cuda_rng_tracker()
                    with tracker.fork(tensor_parallel.random.get_expert_parallel_rng_tracker_name()):
                        init_method(master)
                weight[e].copy_(master)

    def forward(self, permuted_hidden: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor, **_unused):
        """permuted_hidden [N, H] grouped by local expert; tokens_per_expert [E_local] (on the
        device: the offsets never visit the host); permuted_probs [N]. Returns (out [N, H], None)."""
        if tokens_per_expert.device != permuted_hidden.device:  # allgather dispatcher: host counts
            tokens_per_expert = tokens_per_expert.to(permuted_hidden.device, non_blocking=True)
        offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
        probs = permuted_probs.reshape(-1).contiguous()
        gemm = split_gemm = self.fp8_gemm or grouped_mm
        if self.fp8_gemm is not None and self.tp_group.size() > 1:
            # each rank holds F/etp of the contraction: the amax over it spans the expert TP group,
            # so every rank casts with the scales of the unsplit rows (as one GPU does)
            split_gemm = functools.partial(self.fp8_gemm, contraction_group=self.tp_group)
        out = _ExpertMLP.apply(permuted_hidden.contiguous(), self.linear_fc1.weight, self.linear_fc2.weight,
                               probs, offs, self.recompute_act and torch.is_grad_enabled(), gemm, split_gemm)
        return out, None

    def backward_dw(self):
        """Weight gradients are computed in backward (no delayed wgrad)."""

    # ------------------------------------------------------------ checkpoints

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        if metadata.get("singleton_local_shards", False):
            raise NotImplementedError("GroupedExperts: singleton_local_shards checkpoints are not supported; "
                                      "use the torch_dist format (the default)")
        ep_rank, ep = self.ep_group.rank(), self.ep_group.size()
        tp_rank, tp = self.tp_group.rank(), self.tp_group.size()
        replica_id = (0, 0, self.dp_group.rank())  # experts are replicated over expert-DP only
        axis = len(sharded_offsets)  # the expert axis, after any axes the parents prepend
        expert_axis = (axis, ep_rank, ep)
        key_fc1, key_fc2 = f"{prefix}experts.linear_fc1.weight", f"{prefix}experts.linear_fc2.weight"

        def build_fc1(key, data, replica, flattened_range):
            # [gate_r | up_r] of this ETP rank: two shards of the global [gate | up] rows
            gate, up = torch.chunk(data, 2, dim=1)
            return [ShardedTensor.from_rank_offsets(key, gate, *sharded_offsets, expert_axis,
                                                    (axis + 1, tp_rank, 2 * tp), replica_id=replica,
                                                    prepend_axis_num=axis),
                    ShardedTensor.from_rank_offsets(key, up, *sharded_offsets, expert_axis,
                                                    (axis + 1, tp + tp_rank, 2 * tp), replica_id=replica,
                                                    prepend_axis_num=axis)]

        def merge_fc1(parts):
            return torch.cat(parts, dim=1)

        fc1 = ShardedTensorFactory(key_fc1, self.linear_fc1.weight, build_fc1, merge_fc1, replica_id)
        fc2 = ShardedTensor.from_rank_offsets(key_fc2, self.linear_fc2.weight, *sharded_offsets, expert_axis,
                                              (axis + 2, tp_rank, tp), replica_id=replica_id,
                                              prepend_axis_num=axis)
        return {f"{prefix}linear_fc1.weight": fc1, f"{prefix}linear_fc2.weight": fc2}

    def _stack_sequential_names(self, state_dict, prefix, *_args):
        """SequentialMLP's plain names (``local_experts.<i>.linear_fc1.weight``) -> the stacked weights."""
        found: dict[str, dict[int, torch.Tensor]] = {}
        for key in [k for k in state_dict if k.startswith(prefix)]:
            match = _SEQUENTIAL_NAME.fullmatch(key[len(prefix):])
            if match and match.group(3) == "_extra_state":
                state_dict.pop(key)  # megatron's local linear layers keep nothing there
            elif match:
                found.setdefault(match.group(2), {})[int(match.group(1))] = state_dict.pop(key)
        for layer, experts in found.items():
            if sorted(experts) != list(range(self.num_local_experts)):
                raise KeyError(f"{prefix}: SequentialMLP state has experts {sorted(experts)} for {layer}, "
                               f"expected 0..{self.num_local_experts - 1}")
            state_dict[f"{prefix}{layer}.weight"] = torch.stack([experts[e] for e in range(self.num_local_experts)])
