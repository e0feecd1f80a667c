"""FP8 training (``train.fp8``): the decoder's linear layers and routed experts run their GEMMs in FP8.

Where it goes in: megatron's Column/RowParallelLinear compute through ``self._forward_impl``
(the GEMM, the sequence-parallel gather, the input-gradient reduction, the fused accumulation
into ``main_grad``). ``convert`` replaces that one method on each chosen layer with
``_Fp8Linear``, which does the same work with FP8 GEMMs (models/common/fp8_gemm.py), so the
layer's parameters, checkpoint keys, LoRA hook, TP/SP communication, DDP buckets and the
distributed optimizer are untouched: master weights, optimizer state, checkpoints and HF export
stay bf16/fp32; only the GEMMs' operands are cast, on the fly, each step. The routed experts
(models/common/grouped_experts.py) take ``grouped_mm`` from here instead of the bf16 one.

What stays in high precision: layers matched by ``train.fp8_exclude`` (fnmatch patterns on
module names), layers whose widths are not multiples of 16 (torch's FP8 GEMMs need that), and
the output rows of a megatron GatedDeltaNet's ``in_proj`` that feed beta and alpha (named
``<gdn>.in_proj_ba``: 2 x heads rows that drive the decay, where ms-swift keeps bf16 too),
which are computed beside the FP8 rows from the same input.

Backward casts, per recipe (models/common/fp8_gemm.py): the input gradient is
``grad_out @ W`` with grad_out in the recipe's gradient type; the weight gradient is
``grad_out^T @ x``, both scaled along the tokens under ``rowwise``, and is added straight into
``main_grad`` when megatron's accumulation fusion is on (``added_to_main_grad``).
Saved for backward: the bf16 input (the local shard under sequence parallelism, gathered again
as megatron does) and the weight itself, as in bf16: FP8 adds no saved activations, only
transient casts (``transient_bytes``).
"""

from __future__ import annotations

import fnmatch
import functools
import logging
from dataclasses import dataclass, field

import torch
from megatron.core.tensor_parallel import layers

from fused_kernels import main_grad_accumulate
from fused_kernels.wgrad_accum import added_to_main_grad
from models.common import fp8_gemm
from models.common.fp8_gemm import E4M3, EXPERTS, RECIPES, Recipe

log = logging.getLogger(__name__)

DEFAULT_EXCLUDE = ("vision_model.*", "*.router", "*output_layer", "*embedding*", "*.in_proj_ba")


@dataclass(frozen=True)
class _Spec:
    """One converted linear: its recipe, how TP splits it, and its high-precision tail rows."""

    recipe: Recipe
    split: str  # "out" (column parallel: weight rows split) | "in" (row parallel: columns split)
    tp_group: object
    hp_rows: int  # trailing output rows kept in high precision (GDN's beta / alpha)

    def group(self, split_here: bool):
        return self.tp_group if split_here and self.tp_group is not None and self.tp_group.size() > 1 else None


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    out = x.new_empty((x.shape[0] * group.size(), *x.shape[1:]))
    layers.dist_all_gather_func(out, x.contiguous(), group=group)
    return out


class _Fp8Linear(torch.autograd.Function):
    """megatron's linear GEMM (``linear_with_grad_accumulation_and_async_allreduce`` /
    ``linear_with_frozen_weight``) with FP8 operands; communication done synchronously."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec: _Spec, accumulate: bool, allreduce_dgrad: bool, sequence_parallel: bool,
                tp_group):
        total = _gather_sequence(x, tp_group) if sequence_parallel else x
        x2 = total.reshape(-1, total.shape[-1])
        r, head = spec.recipe, weight.shape[0] - spec.hp_rows
        row_parallel = spec.split == "in"
        # the input's contraction dim (features) is split under row parallelism; a tensorwise weight
        # scale spans every shard, a rowwise one runs along the input features
        if r.rowwise:
            xq = fp8_gemm.quantize(x2, -1, E4M3, r.pow2_scales, spec.group(row_parallel))
            wq = fp8_gemm.quantize(weight[:head], 1, E4M3, r.pow2_scales, spec.group(row_parallel))
            x_scale = w_scale = None
        else:  # the scales are kept for the backward's casts of x and the weight
            xq, x_scale = fp8_gemm.quantize_tensorwise(x2, E4M3, spec.group(row_parallel))
            wq, w_scale = fp8_gemm.quantize_tensorwise(weight[:head], E4M3, spec.group(True))
        out = fp8_gemm.matmul(xq, wq.t(), x.dtype, fast_accum=True)
        if spec.hp_rows:
            out = torch.cat([out, x2 @ weight[head:].t().to(x2.dtype)], dim=-1)
        out = out.view(*total.shape[:-1], weight.shape[0])
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(x, weight, x_scale, xq.inv_scale if not r.rowwise else None,
                              w_scale, wq.inv_scale if not r.rowwise else None)
        ctx.spec, ctx.accumulate, ctx.allreduce_dgrad = spec, accumulate, allreduce_dgrad
        ctx.sequence_parallel, ctx.tp_group, ctx.use_bias = sequence_parallel, tp_group, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, x_scale, x_inv, w_scale, w_inv = ctx.saved_tensors
        spec, r = ctx.spec, ctx.spec.recipe
        head = weight.shape[0] - spec.hp_rows
        column = spec.split == "out"
        total = _gather_sequence(x, ctx.tp_group) if ctx.sequence_parallel else x
        x2 = total.reshape(-1, total.shape[-1])
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        g_head = g2[:, :head]
        # grad_out's contraction dim here (output features) is split under column parallelism
        if r.rowwise:
            gq, g_scale = fp8_gemm.quantize(g_head, -1, r.grad_dtype, r.pow2_scales, spec.group(column)), None
        else:  # its scale again in the weight gradient
            gq, g_scale = fp8_gemm.quantize_tensorwise(g_head, r.grad_dtype, spec.group(column))
        # the weight as the GEMM's second operand ([out, in] read as [K, N]): cast column-major
        if r.rowwise:  # the weight along its output rows, split under column parallelism
            wq = fp8_gemm.quantize(weight[:head], 0, E4M3, r.pow2_scales, spec.group(column), column_major=True)
        else:  # the forward's scale (its amax, reduced once)
            wq = fp8_gemm.quantize_with(weight[:head], w_scale, E4M3, column_major=True, inv=w_inv)
        dx = fp8_gemm.matmul(gq, wq, g2.dtype, fast_accum=False)
        if spec.hp_rows:
            dx = dx + g2[:, head:] @ weight[head:].to(g2.dtype)
        dx = dx.view(*total.shape)

        dw = None
        if ctx.needs_input_grad[1]:
            dw = _weight_grad(weight, g_head, g2[:, head:], x2, gq, g_scale, x_scale, x_inv, ctx.accumulate, r)

        if ctx.sequence_parallel:
            sub = dx.new_empty(x.shape)
            layers.dist_reduce_scatter_func(sub, dx.contiguous(), group=ctx.tp_group)
            dx = sub
        elif ctx.allreduce_dgrad:
            torch.distributed.all_reduce(dx, group=ctx.tp_group)
        db = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.use_bias else None
        return dx, dw, db, None, None, None, None, None


def _weight_grad(weight, g_head, g_tail, x2, gq, g_scale, x_scale, x_inv, accumulate: bool, r: Recipe):
    """grad_out^T @ x: FP8 for the head rows, high precision for the tail; into main_grad when fused."""
    main = weight.main_grad if accumulate and hasattr(weight, "main_grad") else None
    # the weight's dtype, also when adding into main_grad: torch's rowwise FP8 GEMM writes bf16 only
    out_dtype = weight.dtype
    if fp8_gemm.token_major_reason(x2) is None:
        # both operands cast straight into the token-contiguous layout the GEMM takes (one pass
        # each, instead of a cast and an fp8 transposed copy); the same scales as below
        if r.rowwise:
            gtq = fp8_gemm.token_major(g_head, E4M3, r)
            xq = fp8_gemm.token_major(x2, E4M3, r).t()
        else:
            gtq = fp8_gemm.token_major(g_head, r.grad_dtype, r, scale=g_scale, inv=gq.inv_scale)
            xq = fp8_gemm.token_major(x2, E4M3, r, scale=x_scale, inv=x_inv).t()
    elif r.rowwise:  # both operands along the tokens: neither is split there
        gtq = fp8_gemm.quantize(g_head.t(), -1, E4M3, r.pow2_scales)
        xq = fp8_gemm.quantize(x2, 0, E4M3, r.pow2_scales)
    else:  # the same tensor scales as the forward and the input gradient
        gtq = gq.t()
        xq = fp8_gemm.quantize_with(x2, x_scale, E4M3, inv=x_inv)
    dw_head = fp8_gemm.matmul(gtq, xq, out_dtype, fast_accum=False)
    dw_tail = (g_tail.t() @ x2.to(g_tail.dtype)) if g_tail.shape[1] else None
    if main is None:
        return dw_head if dw_tail is None else torch.cat([dw_head, dw_tail.to(dw_head.dtype)])
    # fp32 += bf16 through the vectorised kernel (torch's add_ runs it well under the bandwidth)
    main_grad_accumulate.accumulate_(main[:dw_head.shape[0]], dw_head)
    if dw_tail is not None:
        main_grad_accumulate.accumulate_(main[dw_head.shape[0]:], dw_tail.to(dw_head.dtype))
    if hasattr(weight, "grad_added_to_main_grad"):
        return added_to_main_grad(weight)
    return None


def _fp8_forward_impl(module, spec: _Spec, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                      sequence_parallel, tp_group, grad_output_buffer=None, wgrad_deferral_limit=None,
                      gtp_remat_size=1):
    """Stands in for megatron's ``_forward_impl`` (same arguments)."""
    if grad_output_buffer is not None or gtp_remat_size > 1:
        raise RuntimeError(f"train.fp8: {type(module).__name__} uses deferred weight gradients or GTP, which the FP8 "
                           "linear does not implement; add the layer to train.fp8_exclude")
    return _Fp8Linear.apply(input, weight, bias, spec, bool(gradient_accumulation_fusion), bool(allreduce_dgrad),
                            bool(sequence_parallel), tp_group)


# ----------------------------------------------------------------------------- routed experts


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, contraction_group=None) -> torch.Tensor:
    """fused_kernels/grouped_gemm.grouped_mm's two forms with FP8 operands (rowwise scaling);
    ``contraction_group``: the group the 3-D form's contraction K is split over (expert TP), whose
    amaxes are all-reduced over it."""
    r = EXPERTS
    if b.dim() == 3:  # [N, K] x [G, K, M]: a per row, b per (expert, output column), both along K
        aq = fp8_gemm.quantize(a, -1, E4M3, r.pow2_scales, contraction_group)
        bq = fp8_gemm.quantize(b, -2, E4M3, r.pow2_scales, contraction_group, column_major=True)
        return fp8_gemm.grouped_matmul(aq, bq, offs, a.dtype)
    # [K, N] x [N, M] -> [G, K, M]: the contraction runs over each group's tokens
    return fp8_gemm.grouped_weight_grad(a, b, offs, r, a.dtype)


# ----------------------------------------------------------------------------- conversion


@dataclass
class Report:
    recipe: str
    fp8: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)  # by a pattern
    unaligned: list[str] = field(default_factory=list)  # widths not multiples of 16
    tail_rows: list[str] = field(default_factory=list)  # FP8 linears whose last output rows stay bf16
    patterns: tuple[str, ...] = ()

    def line(self) -> str:
        """The one log line: what runs in FP8, what does not, and why."""
        return (f"train.fp8={self.recipe}: {len(self.fp8)} modules in FP8 (linears and grouped experts), "
                f"{len(self.excluded)} kept in bf16 by train.fp8_exclude {list(self.patterns)}"
                + (f", {len(self.tail_rows)} with their *_ba rows (GDN beta / alpha) in bf16" if self.tail_rows else "")
                + (f", {len(self.unaligned)} kept in bf16 as their widths are not multiples of 16 "
                   f"({', '.join(self.unaligned[:3])}{' ...' if len(self.unaligned) > 3 else ''})"
                   if self.unaligned else ""))


def _excluded(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _ba_rows(parent, name: str, patterns) -> int:
    """The in_proj rows of a megatron GatedDeltaNet that feed beta / alpha, when excluded."""
    extra = getattr(parent, "in_proj_extra_dim", None)
    if extra is None or not _excluded(f"{name}_ba", patterns):
        return 0
    return extra // getattr(parent, "tp_size", 1)  # in_proj_extra_dim counts all TP ranks' rows


def convert(model: torch.nn.Module, recipe: str, exclude=DEFAULT_EXCLUDE) -> Report:
    """Put FP8 into every megatron linear and grouped-experts module of ``model`` (one chunk)
    whose name matches no pattern of ``exclude``; returns what it did. Idempotent per module."""
    if recipe not in RECIPES:
        raise ValueError(f"train.fp8={recipe!r} is not a recipe; choose one of {sorted(RECIPES)} or null")
    rec = RECIPES[recipe]
    report = Report(recipe, patterns=tuple(exclude))
    parents = {name: module for name, module in model.named_modules()}
    for name, module in model.named_modules():
        if hasattr(module, "fp8_gemm"):  # models/common/grouped_experts.py
            if _excluded(name, exclude):
                report.excluded.append(name)
                continue
            if not fp8_gemm.aligned(*module.linear_fc1.weight.shape[1:], *module.linear_fc2.weight.shape[1:]):
                report.unaligned.append(name)
                continue
            module.fp8_gemm = grouped_mm
            report.fp8.append(name)
            continue
        if not isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear)):
            continue
        if _excluded(name, exclude):
            report.excluded.append(name)
            continue
        parent = parents.get(name.rpartition(".")[0])
        hp_rows = _ba_rows(parent, name, exclude) if name.endswith("in_proj") and parent is not None else 0
        out_rows, in_cols = module.weight.shape
        if not fp8_gemm.aligned(out_rows - hp_rows, in_cols):
            report.unaligned.append(name)
            continue
        split = "in" if isinstance(module, layers.RowParallelLinear) else "out"
        spec = _Spec(rec, split, getattr(module, "tp_group", None), hp_rows)
        module._forward_impl = functools.partial(_fp8_forward_impl, module, spec)
        module.fp8_recipe = recipe
        report.fp8.append(name)
        if hp_rows:
            report.tail_rows.append(name)
    return report


def transient_bytes(m, tokens: float, tp: int = 1) -> float:
    """Peak bytes FP8 adds over bf16 while one GEMM runs, for ``tokens`` tokens of a micro-batch on
    a rank of model section ``m``: fp8 copies (one byte an element) of the activation and its
    gradient at the widest FP8 GEMM (the MLP's fc1, [gate | up]; for routed experts each token's
    top-k rows), and of the largest weight twice (row- and column-major). Casts are made per GEMM
    and freed after it: nothing accumulates across layers or micro-batches (no weight cache), so
    this counts once per rank, not per layer."""
    if getattr(m, "num_experts", 0):
        rows, width = tokens * getattr(m, "moe_router_topk", 1), 2 * getattr(m, "moe_ffn_hidden_size", 0)
    else:
        rows, width = tokens, 2 * m.ffn_hidden_size // tp
    width = max(width, m.hidden_size)
    return 2 * rows * width + 2 * m.hidden_size * width
