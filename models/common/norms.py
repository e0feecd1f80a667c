"""RMS norms with the exact numerics of the Qwen3.5 reference.

megatron-core's local (non-transformer-engine) norm wraps ``torch.nn.RMSNorm``, which has
no zero-centred gamma. Qwen3.5 uses two kinds:
- ``RMSNorm``: ``x / rms(x) * (1 + w)`` computed in fp32 (w starts at 0) when the config's
  ``layernorm_zero_centered_gamma`` is set, else ``* w`` (w starts at 1). Used for the
  decoder norms and the attention q/k norms.
- ``GatedRMSNorm``: the GDN output norm, ``w * norm(x) * silu(gate)`` (w starts at 1).
Both take megatron's norm constructor arguments so layer specs can build them.

Speed: written out in PyTorch, each norm is 6-8 elementwise kernels per direction over the
activations in fp32, each a full read and write of the activations, a visible share of the
step (profile in docs/kernels.md). On a GPU the same functions go through ``torch.compile``
(``model.compile_norms``, default on for CUDA), which fuses each direction into one or two
Triton kernels with the same fp32 math and casts. The eager functions below stay the
reference (tests compare the compiled ones against them).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# None: compile on CUDA tensors only; True/False: force (set by the model builder from model.compile_norms)
COMPILE: bool | None = None
_compiled: dict = {}
RECOMPILE_LIMIT = 64


def allow_recompiles(limit: int) -> None:
    """Raise dynamo's per-function recompile limit for the whole process to ``limit`` (never lower
    it): a compiled function that serves many input kinds (every norm site, every FP8 operand kind)
    needs more than dynamo's default of 8. Called once where such a function is compiled, not per
    call (a config patch around each call would cost host time on the hot path)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    # .view: x enters the norm through one autograd node, so the norm's two uses of it are summed
    # before they meet the residual's gradient. (On fp32, .float() is x itself, and the engine
    # would add the three contributions in arrival order, which the discard-output recompute of
    # this norm cannot reproduce bit for bit.)
    xf = x.float().view(x.shape)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float()
    y = y * (1.0 + w) if zero_centered else y * w
    return y.to(x.dtype)


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    in_dtype = x.dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * y.to(in_dtype)
    y = y * F.silu(gate.float())
    return y.to(in_dtype)


def _impl(fn, x: torch.Tensor):
    use = x.is_cuda if COMPILE is None else COMPILE
    if not use:
        return fn
    compiled = _compiled.get(fn)
    if compiled is None:
        # one compiled function serves every norm site x grad mode x input layout (strides);
        # dynamo's default of 8 variants per function is too few for that
        allow_recompiles(RECOMPILE_LIMIT)
        compiled = _compiled[fn] = _FirstCallFallback(fn)
        log.info("norms: %s runs through torch.compile (model.compile_norms)", fn.__name__)
    return compiled


# what a failed compilation raises; TritonUnavailableError is missing from some torch releases
_COMPILE_FAILURES = tuple(getattr(torch._dynamo.exc, name) for name in
                          ("BackendCompilerFailed", "TritonUnavailableError", "InternalTorchDynamoError")
                          if hasattr(torch._dynamo.exc, name))


class _FirstCallFallback:
    """``torch.compile(fn)`` whose compilation happens on the first call; if that fails (no
    Triton for Inductor, an unsupported platform), say so once and run the eager function from
    then on, rather than stopping the run. Later errors are real errors and propagate."""

    def __init__(self, fn):
        self.fn = fn
        # dynamic: the token count changes every batch; one graph serves all of them
        self.compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        self.checked = False
        self.eager_variants = 0  # calls past dynamo's recompile limit, run eagerly

    def __call__(self, *args):
        if self.checked:
            try:
                return self.compiled(*args)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                # one function serves every norm of the model (decoder, q/k, GDN, vision) in each
                # grad mode and input layout: a validation pass (no grad, eager layers beside the
                # graphed ones) can add variants past the limit. Those calls run eagerly.
                if not self.eager_variants:
                    log.warning("norms: torch.compile of %s reached torch._dynamo.config.recompile_limit=%d; "
                                "further input variants run the eager norm", self.fn.__name__,
                                torch._dynamo.config.recompile_limit)
                self.eager_variants += 1
                return self.fn(*args)
        try:
            out = self.compiled(*args)
        except _COMPILE_FAILURES as e:
            log.warning("norms: torch.compile of %s failed (%s: %s); using the eager PyTorch norm "
                        "(set model.compile_norms=false to skip the attempt)", self.fn.__name__,
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self.compiled = self.fn
            out = self.fn(*args)
        self.checked = True
        return out


class RMSNorm(nn.Module):
    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, zero_centered: bool | None = None):
        super().__init__()
        if zero_centered is None:
            zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        self.zero_centered = zero_centered
        self.eps = eps
        dtype = getattr(config, "params_dtype", torch.float32)
        init = torch.zeros if zero_centered else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=dtype))
        if config is not None and getattr(config, "sequence_parallel", False):
            # megatron all-reduces grads of params marked this way across the TP group.
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _impl(rms_norm_ref, x)(x, self.weight, self.eps, self.zero_centered)


class GatedRMSNorm(nn.Module):
    """Norm-before-gate RMSNorm of the GDN output (per value head)."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        dtype = getattr(config, "params_dtype", torch.float32)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return _impl(gated_rms_norm_ref, x)(x, gate, self.weight, self.eps)
