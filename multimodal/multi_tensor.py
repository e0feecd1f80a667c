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

``install()`` replaces those with torch's own multi-tensor (``_foreach_*``) kernels, which
megatron calls through the very hooks TE/Apex would fill, and ``use_fused_adam()`` switches
the torch AdamW inside megatron's optimizer to ``fused=True`` (one kernel per group and
dtype). Results are the same up to fp32 summation order (tested). When TE or Apex is
installed, megatron uses their kernels and this module leaves it alone.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_INSTALLED = False


def _l2_norm(_chunk_size, _noop_flag, tensor_lists, _per_tensor, *args):
    """amp_C.multi_tensor_l2norm: (norm of all tensors of the first list, as a 1-element tensor, None)."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


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


def install() -> bool:
    """Fill megatron-core's multi-tensor hooks with torch ``_foreach`` kernels if it fell back to
    its Python loops. Returns True when it did (idempotent)."""
    global _INSTALLED
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer

    if _INSTALLED:
        return True
    if clip_grads.l2_norm_impl is not mutils.local_multi_tensor_l2_norm:
        return False  # TransformerEngine or Apex kernels are in use
    clip_grads.multi_tensor_applier = _apply
    clip_grads.l2_norm_impl = _l2_norm
    clip_grads.multi_tensor_scale_impl = _scale
    # with a tensor-scale op present, megatron keeps the grad norm on the device and clips with
    # a tensor coefficient: no .item() in the optimizer step
    clip_grads.multi_tensor_scale_tensor_impl = _scale
    moptimizer.multi_tensor_applier = _apply
    moptimizer.multi_tensor_scale_impl = _scale
    _INSTALLED = True
    log.info("megatron-core without TransformerEngine/Apex: grad norm, clipping and param copies use "
             "torch _foreach kernels (multimodal/multi_tensor.py)")
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
