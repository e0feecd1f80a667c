"""FP8 GEMMs without Transformer Engine: the recipes' scaling, torch's scaled GEMMs, and their reference.

Recipes (the names torchao's float8 training uses; what each operand is cast to):

- ``tensorwise``: one scale per tensor; input and weight in e4m3, the output gradient in e5m2
  (its wider range for gradients); scales are exact quotients ``fp8_max / amax``.
- ``rowwise``: one scale per row of each operand along the GEMM's contraction dimension (per
  token for activations, per output feature for the weight in forward, per input feature in
  backward); every operand in e4m3 (the rowwise kernel takes e4m3 only); scales rounded down to
  a power of two so that scaling and unscaling are exact.

Scales are computed on the device from the tensor's current amax (``dynamic`` scaling: no
history, no host sync, so CUDA graphs capture them); an amax over a dimension that tensor
parallelism splits is all-reduced (MAX) over the group, so every rank uses the scale the
unsplit tensor would have, and a TP run quantizes exactly as the single-GPU run does.

``Quantized`` is an fp8 tensor with the reciprocal of its scale (broadcastable to it):
``data.float() * inv_scale`` is the dequantized value. ``matmul`` and ``grouped_matmul`` run
``torch._scaled_mm`` / ``torch._scaled_grouped_mm`` on CUDA with compute capability >= 9.0,
and otherwise the reference: dequantize both operands and multiply in fp32 (the CPU path and
the tests' ground truth), with one warning naming why the fast path did not run.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from core.devices import hopper_reason
from fused_kernels import fp8_rowwise as rowwise
from fused_kernels import fp8_tensorwise as tensorwise
from fused_kernels import fp8_token_groups as token_groups
from fused_kernels.grouped_gemm import grouped_mm_reference
from models.common.norms import RECOMPILE_LIMIT, allow_recompiles

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_AMAX_FLOOR = 1e-12  # an all-zero tensor gets a finite scale (its quantized values stay zero)
_ALIGN = 16  # torch's scaled GEMMs need the contraction and output widths to be multiples of 16


@dataclass(frozen=True)
class Recipe:
    name: str
    rowwise: bool  # one scale per row along the contraction dimension; else one per tensor
    grad_dtype: torch.dtype  # the output gradient's fp8 type
    pow2_scales: bool

    def dim(self, contraction: int) -> int | None:
        """The dimension an amax runs over: the contraction dimension (rowwise) or all (None)."""
        return contraction if self.rowwise else None


RECIPES = {
    "tensorwise": Recipe("tensorwise", rowwise=False, grad_dtype=E5M2, pow2_scales=False),
    "rowwise": Recipe("rowwise", rowwise=True, grad_dtype=E4M3, pow2_scales=True),
}
# torch's grouped FP8 GEMM takes rowwise e4m3 scaling only: the routed experts use it under either recipe
EXPERTS = RECIPES["rowwise"]


class Quantized(NamedTuple):
    data: torch.Tensor  # fp8
    inv_scale: torch.Tensor  # fp32, broadcastable to data

    def t(self) -> Quantized:
        return Quantized(self.data.t(), self.inv_scale.t() if self.inv_scale.dim() == 2 else self.inv_scale)

    def dequantize(self) -> torch.Tensor:
        return self.data.float() * self.inv_scale


def _amax(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    return (x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)).float()


def _scaled_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


@functools.cache
def _compiled(fn, backend: str = "inductor"):
    """``fn`` compiled by inductor into one fused kernel: eagerly, |x|, the fp32 product, the clamp
    and the cast each make a pass over the tensor and a temporary, which would eat much of what
    the FP8 GEMM saves. Compiled once per shape family (dynamic), before any CUDA-graph capture.
    The input goes in detached, outside autograd (the casts are never differentiated), so whether
    it requires grad is not one more reason to recompile. dynamo compiles a cast once per operand
    kind it meets (rank, layout, scale shape, fp8 type, amax dimension): a model's linears and
    experts need more than its default limit of 8, raised here as for the norms."""
    allow_recompiles(RECOMPILE_LIMIT)
    compiled = torch.compile(fn, dynamic=True, fullgraph=True, backend=backend)

    def call(x: torch.Tensor, *args):
        with torch.no_grad():
            return compiled(x.detach(), *args)

    return call


def _kernel(fn, x: torch.Tensor):
    if x.device.type != "cuda" or _compile_refused() is not None:
        return fn
    return _compiled(fn)


@functools.cache
def _compile_refused() -> str | None:
    try:
        import triton  # noqa: F401, PLC0415
    except ImportError:
        log.warning("FP8: Triton is not importable; the casts run eagerly (several passes per tensor)")
        return "no triton"
    return None


def amax(x: torch.Tensor, dim: int | None, group=None) -> torch.Tensor:
    """fp32 max |x| over ``dim`` (kept, size 1) or over all of x (0-dim); all-reduced over ``group``."""
    return _all_reduced(_kernel(_amax, x)(x, dim), group)


def _all_reduced(a: torch.Tensor, group) -> torch.Tensor:
    """``a`` with its MAX over ``group`` (as it is without one, or with one of size 1)."""
    if group is not None and group.size() > 1:
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
    return a


def scale_from_amax(a: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """The multiplier that maps amax onto the fp8 type's largest finite value (rounded down to a
    power of two when ``pow2``: never above it, so nothing saturates that would not have)."""
    scale = torch.finfo(dtype).max / a.clamp(min=_AMAX_FLOOR)
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def _scaled_cast_column_major(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cast, written column-major (the last two dims transposed in memory), as torch's FP8 GEMMs
    take their second operand: compiled, the transpose is part of the cast's one kernel, instead of
    a second pass of torch's generic copy over the fp8 bytes (slow on a transpose)."""
    return _scaled_cast(x, scale, dtype).mT.contiguous().mT


def quantize_with(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, column_major: bool = False,
                  inv: torch.Tensor | None = None) -> Quantized:
    """``x`` cast with ``scale`` (``inv``: its reciprocal, when the caller has it); ``column_major``:
    laid out as a GEMM's second operand (a weight in the input gradient's GEMM, a [G, K, M] expert
    weight). A 2-D weight with one scale is cast by the transposing Triton kernel where it runs."""
    inv = scale.reciprocal() if inv is None else inv
    if (column_major and scale.numel() == 1 and x.dim() == 2 and x.shape[0] % _ALIGN == 0
            and tensorwise_kernels_reason(x) is None):
        return Quantized(token_groups.cast_transposed(x, scale, dtype).t(), inv)
    cast = _scaled_cast_column_major if column_major else _scaled_cast
    return Quantized(_kernel(cast, x)(x, scale, dtype), inv)


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype, group=None) -> tuple[Quantized, torch.Tensor]:
    """``x`` [N, C] in ``dtype`` with one scale, its amax all-reduced over ``group``: the cast and the
    scale (the backward casts other operands with it). The Triton kernels where they run (an amax
    and a cast that computes the scale itself: two launches), else the compiled or eager ops."""
    if tensorwise_kernels_reason(x) is None:
        data, scale, inv = tensorwise.cast(x, _all_reduced(tensorwise.tensor_amax(x), group), dtype)
        return Quantized(data, inv), scale
    scale = scale_from_amax(amax(x, None, group), dtype, pow2=False)
    return quantize_with(x, scale, dtype), scale


def tensorwise_kernels_reason(x: torch.Tensor) -> str | None:
    """None when the tensorwise Triton kernels cast ``x`` for the fast GEMM, else why not."""
    return _triton_casts_reason(x, tensorwise, "tensorwise")


def rowwise_kernels_reason(x: torch.Tensor) -> str | None:
    """None when the power-of-two Triton kernels cast ``x`` for the fast GEMM, else why not."""
    return _triton_casts_reason(x, rowwise, "rowwise")


def _triton_casts_reason(x: torch.Tensor, kernels, name: str) -> str | None:
    """None when torch's FP8 GEMM runs and ``kernels`` (a module of fused_kernels) can cast ``x``;
    else why not, warned once where the fast GEMM runs without them (the compiled casts take over)."""
    reason = fast_path_reason(x.device)
    if reason is None:
        reason = kernels.available(x)
        if reason is not None:
            _warn_triton_casts(name, reason)
    return reason


@functools.cache
def _warn_triton_casts(name: str, reason: str) -> None:
    log.warning("FP8: the %s Triton casts not used (%s); the compiled casts run instead", name, reason)


def _quantize(x: torch.Tensor, dim: int | None, dtype: torch.dtype, pow2: bool, column_major: bool):
    """amax, scale and cast as one compiled function: for a reduction along rows that fit a
    program (a token's features), inductor makes it one kernel that reads x once."""
    scale = scale_from_amax(_amax(x, dim), dtype, pow2)
    cast = _scaled_cast_column_major if column_major else _scaled_cast
    return cast(x, scale, dtype), scale.reciprocal()


def quantize(x: torch.Tensor, dim: int | None, dtype: torch.dtype, pow2: bool, group=None,
             column_major: bool = False) -> Quantized:
    """``x`` in ``dtype`` with one scale over ``dim`` (None: the whole tensor)."""
    group = group if group is not None and group.size() > 1 else None
    if pow2:
        fused = _quantize_pow2_fused(x, dim, dtype, group, column_major)
        if fused is not None:
            return fused
    if group is None:
        return Quantized(*_kernel(_quantize, x)(x, dim, dtype, pow2, column_major))
    # the amax is all-reduced over the group between the reduction and the cast
    return quantize_with(x, scale_from_amax(amax(x, dim, group), dtype, pow2), dtype, column_major)


def _given_amax(amax_of, x: torch.Tensor, group) -> torch.Tensor | None:
    """The amax a cast kernel is handed when TP splits its reduction (reduced over ``group`` first);
    None without a group: the kernel then takes the amax itself, in the same pass."""
    return None if group is None else _all_reduced(amax_of(x), group)


def _quantize_pow2_fused(x: torch.Tensor, dim: int | None, dtype: torch.dtype, group, column_major: bool):
    """The power-of-two (rowwise and experts') casts through the Triton kernels of
    fused_kernels/fp8_rowwise.py where the form is one they write and they run here; else None.
    - per row of a 2-D x (a token's features, a weight's output row): ``cast_rows``;
    - a 3-D expert weight [G, K, M] per (expert, column) over K, column-major: the rows of its
      [G, M, K] transpose when that is how it lies in memory (``w.mT`` of a contiguous w), else
      ``cast_columns``, which writes the transpose;
    - a 2-D weight per column, column-major (a rowwise linear's input gradient): the token-group
      kernels' one-group amax and transposed cast, whose work is split along the rows too."""
    if dim is None or x.dim() not in (2, 3) or rowwise_kernels_reason(x) is not None:
        return None
    dim %= x.dim()
    if x.dim() == 2 and dim == 1 and not column_major:
        return Quantized(*rowwise.cast_rows(x, dtype, _given_amax(rowwise.row_amax, x, group)))
    if x.dim() == 3 and dim == 1 and column_major:
        groups, k, m = x.shape
        if x.stride(1) == 1 and x.mT.is_contiguous():
            rows = x.mT.reshape(groups * m, k)
            data, inv = rowwise.cast_rows(rows, dtype, _given_amax(rowwise.row_amax, rows, group))
            return Quantized(data.view(groups, m, k).mT, inv.view(groups, 1, m))
        return Quantized(*rowwise.cast_columns(x, dtype, _given_amax(rowwise.column_amax, x, group)))
    if x.dim() == 2 and dim == 0 and column_major and x.shape[0] % _ALIGN == 0:
        scale = scale_from_amax(_all_reduced(token_groups.column_amax(x), group), dtype, pow2=True)  # [1, C]
        return Quantized(token_groups.cast_transposed(x, scale, dtype).t(), scale.reciprocal())
    return None


# ----------------------------------------------------------------------------- fast path or reference


def aligned(*widths: int) -> bool:
    return all(w % _ALIGN == 0 for w in widths)


def fast_path_reason(device: torch.device, grouped: bool = False) -> str | None:
    """None when torch's scaled GEMM runs on ``device``, else why not."""
    return _fast_path_reason(device.type, device.index, grouped)


@functools.cache  # asked once per GEMM: the answer per device never changes
def _fast_path_reason(device_type: str, index: int | None, grouped: bool) -> str | None:
    name = "_scaled_grouped_mm" if grouped else "_scaled_mm"
    if not hasattr(torch, name):
        return f"torch {torch.__version__} has no torch.{name}"
    return hopper_reason(torch.device(device_type, index), "an FP8 GEMM")


@functools.cache
def _warn_emulated(reason: str) -> None:
    log.warning("FP8: torch's scaled GEMMs not used (%s); emulating FP8 (quantize, dequantize, fp32 matmul): "
                "same numerics, no speedup", reason)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-2) == 1 else t.mT.contiguous().mT


def _contraction_padded(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a [M, K] row-major and b [K, N] column-major, K zero-padded to a multiple of 16: torch's FP8
    GEMMs need it (16-byte rows). K is a weight width (16-aligned, or the layer stays bf16) except
    in the dense weight gradient, where it is the token count of a packed row of any length (the
    grouped one pads each expert's group: ``_groups_padded``). The zeros add nothing to any product."""
    k = a.shape[1]
    padded = -(-k // _ALIGN) * _ALIGN
    if padded == k:
        return a.contiguous(), _column_major(b)
    a_pad = torch.zeros(a.shape[0], padded, dtype=a.dtype, device=a.device)
    a_pad[:, :k].copy_(a)
    b_pad = torch.zeros(b.shape[1], padded, dtype=b.dtype, device=b.device)
    b_pad[:, :k].copy_(b.t())
    return a_pad, b_pad.t()


def _groups_padded(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor):
    """The grouped weight-gradient GEMM's operands, a [M, N] and b [N, K] grouped along N by
    ``offs``, with every group's N rounded up to a multiple of 16 by zero columns / rows: torch's
    grouped FP8 GEMM needs each group to start on a 16-byte boundary (a device-side assert), and an
    expert's routed-token count is arbitrary. Returns a row-major, b column-major and the new
    offsets, computed on the device (no host sync). Tokens past the last offset (in no group) stay
    past the new last offset. The zeros add nothing to any group's product. The path of the fused
    kernels (``_grouped_weight_grad_fused``) writes this layout directly."""
    n = a.shape[1]
    new_offs, width = token_groups.padded_offsets(offs, n)
    # each group's tokens end at its new offset (the zeros go before them); the tail follows the last
    shift = torch.cat([new_offs - offs, (new_offs[-1:] - offs[-1:])]).to(torch.int64)
    dest = torch.arange(n, device=a.device) + shift[group_of_rows(offs, n)]
    as_int = token_groups.SAME_SIZE_INT[a.element_size()]
    a_pad = torch.zeros(a.shape[0], width, dtype=as_int, device=a.device)
    a_pad.index_copy_(1, dest, a.contiguous().view(as_int))
    b_pad = torch.zeros(b.shape[1], width, dtype=as_int, device=b.device)  # [K, width]: column-major b
    b_pad.index_copy_(1, dest, b.t().contiguous().view(as_int))
    return a_pad.view(a.dtype), b_pad.view(b.dtype).t(), new_offs


def matmul(a: Quantized, b: Quantized, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N] in ``out_dtype``; a's scale is 0-dim or [M, 1], b's 0-dim or [1, N]."""
    reason = fast_path_reason(a.data.device)
    if reason is None:
        a_data, b_data = _contraction_padded(a.data, b.data)
        return torch._scaled_mm(a_data, b_data, a.inv_scale, b.inv_scale, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    _warn_emulated(reason)
    return (a.dequantize() @ b.dequantize()).to(out_dtype)


def grouped_matmul(a: Quantized, b: Quantized, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Rowwise-scaled grouped GEMM, the two forms of fused_kernels/grouped_gemm.py:

    - a [N, K] (scale [N, 1]) x b [G, K, M] (scale [G, 1, M]) -> [N, M];
    - a [M, N] (scale [G, M, 1], one per group of a's columns) x b [N, K] (scale [G, 1, K], one
      per group of b's rows) -> [G, M, K].
    """
    reason = fast_path_reason(a.data.device, grouped=True)
    if reason is None:
        if b.data.dim() == 3:
            a_data, b_data = a.data.contiguous(), _column_major(b.data)
            sa, sb = a.inv_scale.reshape(-1), b.inv_scale.reshape(b.data.shape[0], -1)
        else:
            a_data, b_data, offs = _groups_padded(a.data, b.data, offs)
            sa, sb = a.inv_scale.reshape(-1), b.inv_scale.reshape(-1)
        return torch._scaled_grouped_mm(a_data, b_data, sa, sb, offs=offs, out_dtype=out_dtype, use_fast_accum=True)
    _warn_emulated(reason)
    if b.data.dim() == 3:
        return grouped_mm_reference(a.dequantize(), b.dequantize(), offs).to(out_dtype)
    rows = group_of_rows(offs, a.data.shape[1])  # a's columns / b's rows -> their group
    a_deq = a.data.float() * a.inv_scale[rows.clamp(max=offs.numel() - 1)].squeeze(-1).t()
    b_deq = b.data.float() * b.inv_scale[rows.clamp(max=offs.numel() - 1)].squeeze(1)
    return grouped_mm_reference(a_deq, b_deq, offs).to(out_dtype)


# ----------------------------------------------------------------------------- per-group scales


group_of_rows = token_groups.group_of_rows
group_amax = token_groups.group_amax_reference


def quantize_grouped_rows(x: torch.Tensor, offs: torch.Tensor, recipe: Recipe) -> Quantized:
    """x [N, C] with one scale per (group of rows, column): scale [G, 1, C]."""
    scale = scale_from_amax(group_amax(x, offs), E4M3, recipe.pow2_scales)  # [G, C]
    rows = group_of_rows(offs, x.shape[0]).clamp(max=offs.numel() - 1)
    q = quantize_with(x, scale[rows], E4M3)
    return Quantized(q.data, scale.reciprocal()[:, None, :])


def quantize_grouped_cols(x: torch.Tensor, offs: torch.Tensor, recipe: Recipe) -> Quantized:
    """x [C, N] with one scale per (row, group of columns): scale [G, C, 1]."""
    scale = scale_from_amax(group_amax(x.t(), offs), E4M3, recipe.pow2_scales)  # [G, C]
    cols = group_of_rows(offs, x.shape[1]).clamp(max=offs.numel() - 1)
    q = quantize_with(x, scale[cols].t(), E4M3)
    return Quantized(q.data, scale.reciprocal()[:, :, None])


# ----------------------------------------------------------------------------- the experts' weight gradient


@functools.cache
def _warn_unfused(reason: str) -> None:
    log.warning("FP8: the grouped weight gradient's fused quantization not used (%s); quantizing with torch "
                "ops (several passes per operand, much slower)", reason)


def grouped_weight_grad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, recipe: Recipe,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, N] x b [N, K] -> [G, M, K], each group's product over its own slice of N (the tokens an
    expert received: the experts' weight gradient). Rowwise scales per (group, row of a) and
    (group, column of b). Where torch's grouped FP8 GEMM runs, two Triton kernels per operand
    quantize it straight into the GEMM's padded layout (fused_kernels/fp8_token_groups.py)."""
    if fast_path_reason(a.device, grouped=True) is None:
        reason = token_groups.available(a.mT) or token_groups.available(b)
        if reason is None:
            return _grouped_weight_grad_fused(a, b, offs, recipe, out_dtype)
        _warn_unfused(reason)
    aq = quantize_grouped_cols(a, offs, recipe)
    bq = quantize_grouped_rows(b, offs, recipe)
    return grouped_matmul(aq, bq, offs, out_dtype)


def _token_group_operand(x: torch.Tensor, offs: torch.Tensor, new_offs: torch.Tensor, width: int, plan,
                         recipe: Recipe):
    """x [N, C] -> ([C, width] e4m3 with the tokens contiguous and each group padded to 16, [G, C] inverse scales)."""
    scale = scale_from_amax(token_groups.group_amax(x, offs, plan), E4M3, recipe.pow2_scales)
    return token_groups.cast_groups_transposed(x, offs, new_offs, width, scale, E4M3, plan), scale.reciprocal()


def _grouped_weight_grad_fused(a, b, offs, recipe: Recipe, out_dtype: torch.dtype) -> torch.Tensor:
    n = b.shape[0]
    new_offs, width = token_groups.padded_offsets(offs, n)
    plan = token_groups.chunk_plan(offs, n)  # both operands' rows are grouped by the same offsets
    a_data, a_inv = _token_group_operand(a.mT, offs, new_offs, width, plan, recipe)  # [M, width], [G, M]
    b_data, b_inv = _token_group_operand(b, offs, new_offs, width, plan, recipe)  # [K, width], [G, K]
    return torch._scaled_grouped_mm(a_data, b_data.t(), a_inv.reshape(-1), b_inv.reshape(-1), offs=new_offs,
                                    out_dtype=out_dtype, use_fast_accum=True)


# ----------------------------------------------------------------------------- the dense weight gradient


@functools.cache
def _warn_token_major(reason: str) -> None:
    log.warning("FP8: the weight gradient's fused cast-and-transpose not used (%s); casting, then copying "
                "the fp8 operands transposed", reason)


def token_major_reason(x: torch.Tensor) -> str | None:
    """None when ``token_major`` runs for x: torch's FP8 GEMM and the Triton kernels both run here;
    else why not (the second, warned once: the fast GEMM then takes the copies)."""
    reason = fast_path_reason(x.device)
    if reason is None:
        reason = token_groups.available(x)
        if reason is not None:
            _warn_token_major(reason)
    return reason


def token_major(x: torch.Tensor, dtype: torch.dtype, recipe: Recipe, scale: torch.Tensor | None = None,
                inv: torch.Tensor | None = None) -> Quantized:
    """x [N, C] as the token-contiguous operand of a weight gradient: [C, width] in ``dtype``, the N
    tokens zero-padded to a multiple of 16 (the contraction of torch's FP8 GEMM), with ``scale``
    (0-dim, tensorwise; ``inv`` its reciprocal when the caller has it) or, when None, one scale per
    column over the tokens (rowwise, [C, 1]). The grouped kernels with one group: the padding zeros
    add nothing to the product."""
    if scale is None:
        scale = scale_from_amax(token_groups.column_amax(x), dtype, recipe.pow2_scales)  # [1, C]
        inv = scale.reciprocal().t()
    elif inv is None:
        inv = scale.reciprocal()
    return Quantized(token_groups.cast_transposed(x, scale, dtype), inv)
