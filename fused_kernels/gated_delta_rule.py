"""Gated DeltaNet core ops: causal depthwise conv1d and the chunked gated delta rule.

Implementations, chosen once per process by ``gdn_backend()``:
- ``flash_qla`` (the delta rule only; ``auto`` picks it where ``flash_qla`` imports on SM90/SM100):
  FlashQLA's fused TileLang kernels, planned by fused_kernels/flash_qla_gdr.py; the conv runs fla's.
- ``fla``: flash-linear-attention's Triton kernels (CUDA only; varlen via cu_seqlens).
- ``torch``: plain PyTorch references below, used on CPU and wherever fla cannot run.
  They handle packed (THD) batches: the conv never reads across a sample boundary
  and the delta-rule state restarts at every sample.

fla 0.6.0 refuses its gated chunk backward on Hopper with 3.4 <= Triton < 3.7.1 (wrong
results upstream, fla issue #640) unless tilelang is importable. We check that at start-up
and choose ``torch`` with one warning instead of crashing in the first backward.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from core.errors import ConfigError
from core.transfer import to_device_async

log = logging.getLogger(__name__)


@functools.cache
def fla_unusable_reason() -> str | None:
    """None if fla's GDN kernels (forward and backward) can run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0
    except Exception as e:  # ImportError, or a Triton/driver mismatch at import
        return f"flash-linear-attention not importable ({e})"
    import fla.utils as fu

    above_371 = getattr(fu, "TRITON_ABOVE_3_7_1", False)
    if IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not above_371:
        if importlib.util.find_spec("tilelang") is None:
            return (
                "fla's gated chunk backward is refused on Hopper with Triton >=3.4,<3.7.1 "
                "(fla #640) and tilelang is not installed"
            )
    return None


GDN_BACKENDS = ("auto", "flash_qla", "fla", "torch")  # model.gdn_backend


@functools.cache
def gdn_backend(requested: str = "auto") -> str:
    """Resolve 'auto' | 'fla' | 'flash_qla' | 'torch' to the backend this process uses; logs the choice."""
    reason = fla_unusable_reason()
    if requested == "torch":
        return "torch"
    from fused_kernels import flash_qla_gdr

    qla_reason = flash_qla_gdr.unusable_reason()
    if requested == "flash_qla" or (requested == "auto" and qla_reason is None):
        if qla_reason:
            raise ConfigError(f"model.gdn_backend=flash_qla cannot run: {qla_reason}; on an SM90 GPU install the "
                              "gpu extra (pip install -e '.[gpu]': flash-qla, tilelang), or set model.gdn_backend=auto")
        log.info("GDN kernels: FlashQLA for the delta rule, flash-linear-attention's conv1d where it imports")
        _no_fla_flash_qla_dispatch()  # a call FlashQLA refuses (dtype, head size) falls back to fla's own kernels
        return "flash_qla"
    if requested == "fla":
        if reason:
            raise ConfigError(f"model.gdn_backend=fla cannot run: {reason}; set model.gdn_backend=auto "
                              "(FlashQLA where it runs, else the PyTorch reference) or install the gpu extra (tilelang)")
        _no_fla_flash_qla_dispatch()
        return "fla"
    if requested != "auto":
        raise ConfigError(f"model.gdn_backend must be one of {'|'.join(GDN_BACKENDS)}, got {requested!r}")
    if reason is None:
        log.info("GDN kernels: flash-linear-attention (FlashQLA: %s)", qla_reason)
        _no_fla_flash_qla_dispatch()
        return "fla"
    level = logging.WARNING if torch.cuda.is_available() else logging.INFO
    log.log(level, "GDN kernels: PyTorch reference (%s; FlashQLA: %s)", reason, qla_reason)
    return "torch"


FLA_FLASH_QLA_ENV = "FLA_FLASH_QLA"


@functools.cache  # once per process: also called on the fla path of every delta-rule call
def _no_fla_flash_qla_dispatch() -> None:
    """fla 0.6.0 hands its delta rule to FlashQLA by itself when flash_qla is installed. That path
    reads cu_seqlens on the host to choose its split and caches the choice per tensor object, so
    with the CUDA graphs' static buffers it would keep the first micro-batch's split for every
    later one. The fla backend therefore runs fla's own kernels; model.gdn_backend=flash_qla runs
    FlashQLA with the split planned per micro-batch (fused_kernels/flash_qla_gdr.py)."""
    if importlib.util.find_spec("flash_qla") is not None and os.environ.get(FLA_FLASH_QLA_ENV) != "0":
        log.info("fla's own dispatch to FlashQLA turned off (%s=0); model.gdn_backend=flash_qla uses it",
                 FLA_FLASH_QLA_ENV)
        os.environ[FLA_FLASH_QLA_ENV] = "0"


def position_in_sample(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Index of each packed token within its own sample, computed on the device."""
    pos = torch.arange(total, device=cu_seqlens.device)
    seg = torch.bucketize(pos, cu_seqlens[1:].to(pos.dtype), right=True)
    return pos - cu_seqlens.to(pos.dtype)[seg]


def causal_conv1d_silu_ref(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """SiLU(causal depthwise conv1d). x [B, T, D], weight [D, W]; resets at sample starts."""
    width = weight.shape[-1]
    if cu_seqlens is None:
        y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), padding=width - 1, groups=x.shape[-1])
        return F.silu(y[..., : x.shape[1]].transpose(1, 2))
    # packed: out[t] = sum_j w[W-1-j] * x[t-j], keeping only taps inside t's sample
    pos = position_in_sample(cu_seqlens, x.shape[1])
    out = x * weight[:, width - 1]
    for j in range(1, width):
        shifted = F.pad(x, (0, 0, j, 0))[:, : x.shape[1]]
        keep = (pos >= j).to(x.dtype)[None, :, None]
        out = out + shifted * keep * weight[:, width - 1 - j]
    return F.silu(out)


def chunk_gated_delta_rule_ref(q, k, v, g, beta, cu_seqlens=None, chunk_size: int = 64):
    """Gated delta rule, chunked, fp32 inside. q,k [B,T,H,K] (already l2-normed), v [B,T,H,V].

    Packed batches (B == 1 with cu_seqlens) run sample by sample so the recurrent state
    restarts at each boundary. That loop reads cu_seqlens on the host: this is the
    reference / CPU path; on GPU fla's varlen kernel is used.
    """
    from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

    if cu_seqlens is None:
        return torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size)[0]
    bounds = cu_seqlens.tolist()
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            o, _ = torch_chunk_gated_delta_rule(
                q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], chunk_size=chunk_size
            )
            outs.append(o)
    return torch.cat(outs, dim=1)


# fla's chunk_gated_delta_rule splits every sample into chunks of this many tokens (its default)
FLA_CHUNK_SIZE = 64


def chunk_indices_host(cu_seqlens: torch.Tensor, chunk_size: int = FLA_CHUNK_SIZE) -> torch.Tensor:
    """[num_chunks, 2] int64: (sample, chunk within the sample) for every ``chunk_size``-token chunk
    of a packed row, from host-side ``cu_seqlens``; the table fla's varlen kernels walk.

    fla builds it itself on every call from the device ``cu_seqlens`` (about fifteen small
    kernels and a host sync in ``repeat_interleave``, per GDN layer and micro-batch); the
    trainer builds it here once per micro-batch on the host instead (see ``GDNVarlen``).
    """
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)
    counts = (lens + chunk_size - 1) // chunk_size
    sample = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    first_chunk = torch.cumsum(counts, 0) - counts
    return torch.stack([sample, torch.arange(sample.numel()) - first_chunk[sample]], 1)


@dataclass
class GDNVarlen:
    """A packed micro-batch's varlen metadata, on the device, shared by every GDN layer:
    ``cu_seqlens`` as int64 (one tensor object, so fla's per-tensor caches hit after the first
    layer) and ``chunk_indices`` from ``chunk_indices_host``. For the flash_qla backend:
    ``cu_host``, the same boundaries on the host, from which ``flash_qla_plan`` builds FlashQLA's
    plan at the first GDN call that wants it (no device read), or ``qla``, a plan given up front
    for ``qla_heads`` heads (the CUDA graphs' fixed-shape one, models/performance/layer_graphs.StaticBatch)."""

    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    qla: object | None = None
    cu_host: torch.Tensor | None = field(default=None, repr=False)
    qla_heads: int | None = None
    _built: dict = field(default_factory=dict, repr=False)  # heads -> plan built from cu_host

    @classmethod
    def from_host(cls, cu_seqlens: torch.Tensor, device) -> "GDNVarlen":
        return cls(to_device_async(cu_seqlens.to(torch.long), device),
                   to_device_async(chunk_indices_host(cu_seqlens), device), cu_host=cu_seqlens)

    def flash_qla_plan(self, heads: int):
        """FlashQLA's plan for this row and ``heads`` value heads (fused_kernels/flash_qla_gdr.py), None
        without host boundaries. Built once per head count: every GDN layer of a rank usually
        shares one, so the first layer plans and the others reuse it."""
        if self.qla is not None:
            if self.qla_heads is not None and heads != self.qla_heads:
                raise ValueError(f"the fixed FlashQLA plan was made for {self.qla_heads} heads, this GDN layer "
                                 f"has {heads}: give StaticBatch the head count of its layers")
            return self.qla
        if self.cu_host is None:
            return None
        if heads not in self._built:
            from fused_kernels.flash_qla_gdr import plan_from_host

            self._built[heads] = plan_from_host(self.cu_host, self.cu_seqlens, heads)
        return self._built[heads]


def _fla_varlen(cu_seqlens: torch.Tensor | None, varlen: GDNVarlen | None):
    """(cu_seqlens, chunk_indices) for fla: the precomputed pair when the trainer gave one."""
    if varlen is not None:
        return varlen.cu_seqlens, varlen.chunk_indices
    return (None if cu_seqlens is None else cu_seqlens.long()), None


def causal_conv1d_silu(x, weight, cu_seqlens, backend: str, varlen: GDNVarlen | None = None):
    if backend == "flash_qla" and fla_unusable_reason() is None:
        backend = "fla"  # FlashQLA has no conv1d; the model's fused pre-GDR kernel usually covers it
    if backend == "fla":
        from fla.modules.convolution import causal_conv1d

        cu, _ = _fla_varlen(cu_seqlens, varlen)
        return causal_conv1d(x=x, weight=weight, bias=None, activation="silu", cu_seqlens=cu)[0]
    return causal_conv1d_silu_ref(x, weight, cu_seqlens)


def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, backend: str, varlen: GDNVarlen | None = None,
                           save_states: bool = False):
    """The delta rule over a batch; ``varlen`` (packed batches, optional) carries the chunk table
    built once per micro-batch, so fla skips its per-call index construction and host sync.
    ``save_states`` (fla only, ``model.gdn_save_states``): keep the chunk states from the forward
    instead of recomputing them in the backward (fused_kernels/fla_saved_states.py)."""
    if backend == "flash_qla":
        from fused_kernels import flash_qla_gdr

        reason = flash_qla_gdr.shape_refusal(q, v)
        if reason is None:
            plan = None
            if cu_seqlens is not None:
                plan = None if varlen is None else varlen.flash_qla_plan(v.shape[2])
                if plan is None:  # a caller without the host boundaries: read them (a sync)
                    plan = flash_qla_gdr.plan_from_host(cu_seqlens.cpu(), cu_seqlens.long(), v.shape[2])
            return flash_qla_gdr.chunk_gated_delta_rule(q, k, v, g, beta, plan)
        backend = "fla" if fla_unusable_reason() is None else "torch"
        _warn_once(f"model.gdn_backend=flash_qla: {reason}; this call runs {backend}")
    if backend == "fla":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

        _no_fla_flash_qla_dispatch()  # "fla" means fla's own kernels, also for callers that skip gdn_backend()

        cu, chunk_indices = _fla_varlen(cu_seqlens, varlen)
        if save_states and torch.is_grad_enabled():
            from fused_kernels.fla_saved_states import chunk_gated_delta_rule_saved_states

            return chunk_gated_delta_rule_saved_states(q, k, v, g, beta, cu, chunk_indices)
        return fla_chunk(q, k, v, g=g, beta=beta, cu_seqlens=cu, chunk_indices=chunk_indices,
                         chunk_size=FLA_CHUNK_SIZE, use_qk_l2norm_in_kernel=False)[0]
    return chunk_gated_delta_rule_ref(q, k, v, g, beta, cu_seqlens)


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
