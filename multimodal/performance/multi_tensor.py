"""Fast optimizer-step plumbing for megatron-core when neither TransformerEngine nor Apex is installed.

Without TE/Apex, megatron-core falls back to Python loops for its multi-tensor helpers
(``megatron.core.utils.local_multi_tensor_*``), and to ``torch.optim.AdamW`` in its default
(foreach, several passes over the state) form. On a 2B model that costs, every step:
- the gradient norm: one ``torch.norm`` per parameter, then ``torch.tensor(list_of_cuda_scalars)``,
  which reads every scalar back to the host (one device sync per parameter tensor), then a
  final ``.item()``; given a tensor-valued scale op, megatron instead keeps the norm on the
  device and clips with a tensor coefficient, so the step has no host sync at all;
- gradient clipping: one multiply per parameter;
- AdamW: torch's foreach implementation, several kernels per parameter group.

``use_foreach_kernels()`` replaces those with torch's own multi-tensor (``_foreach_*``) kernels, which
megatron calls through the very hooks TE/Apex would fill, and ``use_fused_adam()`` switches
the torch AdamW inside megatron's optimizer to ``fused=True`` (one kernel per group and
dtype). Results are the same up to fp32 summation order (tested). When TE or Apex is
installed, megatron uses their kernels and this module leaves it alone.
"""

from __future__ import annotations

import logging

import torch

from core import compat

log = logging.getLogger(__name__)

_INSTALLED = False
_DEFERRED: "DeferredGradScale | None" = None  # the one active in this process (at most one trainer)


def _l2_norm(_chunk_size, _noop_flag, tensor_lists, _per_tensor, *args):
    """amp_C.multi_tensor_l2norm: (norm of all tensors of the first list, as a 1-element tensor, None).
    While a gradient scale is deferred (DeferredGradScale), the gradients in memory are unscaled
    and the norm megatron asks for is that of the scaled ones."""
    norms = torch._foreach_norm(tensor_lists[0])
    norm = torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1)
    if _DEFERRED is not None and _DEFERRED.scale is not None:
        norm = norm * _DEFERRED.scale
    return norm, None


def _clip_scale(chunk_size, noop_flag, tensor_lists, scale):
    """megatron's gradient clipping (grads *= clip coefficient, a device tensor): folded into the
    deferred scale when one is active, else done in place."""
    if _DEFERRED is not None and _DEFERRED.scale is not None and tensor_lists[0] is tensor_lists[1]:
        _DEFERRED.fold(scale)
        return
    _scale(chunk_size, noop_flag, tensor_lists, scale)


def _scale(_chunk_size, _noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale (and TE's tensor-scale variant): dst = src * scale, where scale is a
    Python number or a one-element tensor (then it never leaves the device)."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if torch.is_tensor(scale):
        scale = scale.reshape(())
    if src is dst or all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif not torch.is_tensor(scale) and scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _apply(op, noop_flag, tensor_lists, *args):
    return op(None, noop_flag, tensor_lists, *args)


def use_foreach_kernels() -> bool:
    """Fill megatron-core's multi-tensor hooks with torch ``_foreach`` kernels if it fell back to
    its Python loops. Returns True when it did (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return True
    if compat.get(compat.CLIP_L2_NORM) is not compat.get(compat.LOCAL_L2_NORM):
        return False  # TransformerEngine or Apex kernels are in use
    compat.replace(compat.CLIP_APPLIER, _apply)
    compat.replace(compat.CLIP_L2_NORM, _l2_norm)
    compat.replace(compat.CLIP_SCALE, _scale)
    # with a tensor-scale op present, megatron keeps the grad norm on the device and clips with
    # a tensor coefficient: no .item() in the optimizer step
    compat.replace(compat.CLIP_SCALE_TENSOR, _clip_scale)
    compat.replace(compat.OPT_APPLIER, _apply)
    compat.replace(compat.OPT_SCALE, _scale)
    _INSTALLED = True
    log.info("megatron-core without TransformerEngine/Apex: grad norm, clipping and param copies use "
             "torch _foreach kernels (multimodal/performance/multi_tensor.py)")
    return True


def torch_adam_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch Adam/AdamW instances inside a megatron (chained) optimizer."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    found = []
    for opt in inner:
        base = getattr(opt, "optimizer", None)
        if isinstance(base, (torch.optim.Adam, torch.optim.AdamW)):
            found.append(base)
    return found


def use_fused_adam(optimizer) -> int:
    """Switch torch Adam/AdamW groups inside ``optimizer`` to the fused kernel where torch supports it
    for every parameter (floating point, CUDA or CPU). Returns the number of groups switched; a
    group that cannot be fused stays on foreach, with one warning saying why."""
    switched = 0
    for opt in torch_adam_optimizers(optimizer):
        mine = 0
        for group in opt.param_groups:
            if group.get("fused"):
                continue
            bad = any(not (p.is_floating_point() and p.device.type in ("cuda", "cpu")) for p in group["params"])
            if bad or group.get("capturable") or group.get("differentiable"):
                log.warning("optimizer: a parameter group stays on torch's foreach AdamW (fused needs "
                            "floating-point CUDA/CPU params, not capturable/differentiable)")
                continue
            group["fused"], group["foreach"] = True, False
            mine += 1
        if mine:  # groups added later (none in megatron) follow this optimizer's choice
            opt.defaults["fused"], opt.defaults["foreach"] = True, False
        switched += mine
    return switched


class DeferredGradScale:
    """Folds megatron's two extra passes over the fp32 gradients into the fused AdamW kernel.

    Each step megatron multiplies every gradient by 1/(supervised tokens) (finalize_model_grads,
    with calculate_per_token_loss) and then by the clipping coefficient: two read-and-write passes
    over 4 bytes x parameters, a visible share of the step (profile in docs/kernels.md). torch's
    fused AdamW divides each gradient by its ``grad_scale`` tensor as it reads it (the AMP hook),
    so here both factors are kept as one device scalar instead: the DDP wrapper's
    ``scale_gradients`` records the token factor, the gradient norm is computed from the unscaled
    gradients and multiplied by it (same value up to rounding), the clip coefficient multiplies
    into it, and the fused kernel applies ``1 / scale``. No host sync.

    Only for one megatron optimizer whose torch AdamW groups are all fused and whose parameters
    share one clipping group (``defer_grad_scaling`` checks; MoE's separate expert optimizer keeps megatron's
    path). While nothing is deferred every hook does exactly what it did before.
    """

    def __init__(self, adams: list[torch.optim.Optimizer]):
        self.adams = adams
        self.scale: torch.Tensor | None = None  # the product of the deferred factors, [1] fp32

    def defer(self, factor) -> None:
        """megatron's ``scale_gradients(factor)``: remember instead of multiplying."""
        device = self.adams[0].param_groups[0]["params"][0].device
        self.scale = torch.as_tensor(factor, dtype=torch.float32, device=device).reshape(1).clone()
        self._arm()

    def fold(self, coefficient) -> None:
        self.scale = self.scale * torch.as_tensor(coefficient, dtype=torch.float32).reshape(1)
        self._arm()

    def _arm(self) -> None:
        inv = 1.0 / self.scale
        for opt in self.adams:
            opt.grad_scale = inv

    def wrap_step(self, step):
        """``optimizer.step`` that ends the deferral afterwards, applied or skipped."""
        def run(*args, **kwargs):
            try:
                return step(*args, **kwargs)
            finally:
                self.scale = None
                for opt in self.adams:
                    opt.grad_scale = None
        return run


def stop_deferring() -> None:
    """Forget the active DeferredGradScale (end of training): it references the torch optimizer,
    whose state (12 bytes per parameter) would otherwise outlive the trainer."""
    global _DEFERRED
    _DEFERRED = None


def defer_grad_scaling(optimizer, ddp_chunks) -> DeferredGradScale | None:
    """Install a DeferredGradScale on ``optimizer`` and the DDP-wrapped ``ddp_chunks`` when it is
    exact to do so; returns it, or None (with the reason logged) when megatron's passes stay."""
    global _DEFERRED
    why = None
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    adams = torch_adam_optimizers(optimizer)
    if not _INSTALLED:
        why = "TransformerEngine/Apex kernels are in use"
    elif len(chained) != 1 or len(adams) != 1:
        why = f"{len(chained)} optimizers (each would clip its own parameters)"
    elif not all(g.get("fused") for g in adams[0].param_groups):
        why = "AdamW is not fused (optimizer.fused=false)"
    elif any(getattr(p, "grad_norm_group", None) is not None for g in adams[0].param_groups for p in g["params"]):
        why = "some parameters are clipped in a separate gradient-norm group"
    if why is not None:
        log.info("optimizer: gradient scaling and clipping stay separate passes (%s)", why)
        return None
    deferred = DeferredGradScale(adams)
    for chunk in ddp_chunks:
        chunk.scale_gradients = deferred.defer
    optimizer.step = deferred.wrap_step(optimizer.step)
    _DEFERRED = deferred
    log.info("optimizer: the 1/tokens gradient scale and the clip coefficient are applied inside the "
             "fused AdamW kernel (grad_scale), not as separate passes")
    return deferred
