"""torch _foreach kernels in megatron's multi-tensor hooks, and fused AdamW: same numbers as
megatron's own Python-loop fallbacks and torch's foreach AdamW."""

from __future__ import annotations

import pytest
import torch
from megatron.core import utils as mutils

from multimodal.performance import multi_tensor


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in [(7,), (3, 5), (64, 33), (1,)]]


def test_l2_norm_matches_megatrons_loop():
    ts = _tensors()
    ours, _ = multi_tensor._l2_norm(None, None, [ts], False)
    ref = torch.linalg.vector_norm(torch.cat([t.flatten() for t in ts]))
    assert ours.shape == (1,) and torch.allclose(ours[0], ref, rtol=1e-6)
    loop = mutils.local_multi_tensor_l2_norm  # megatron's fallback creates its result on "cuda"
    if torch.cuda.is_available():
        assert torch.allclose(loop(None, None, [ts], False)[0].cpu(), ours, rtol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 0.25, "tensor"])
def test_scale_copies_and_scales_like_amp_c(scale):
    src = _tensors(1)
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]  # fp32 main -> bf16 model params
    s = torch.tensor([0.5]) if scale == "tensor" else scale
    multi_tensor._scale(None, None, [src, dst], s)
    factor = 0.5 if scale == "tensor" else scale
    for a, b in zip(src, dst):
        assert b.dtype == torch.bfloat16 and torch.equal(b, (a * factor).to(torch.bfloat16))
    inplace = _tensors(2)
    before = [t.clone() for t in inplace]
    multi_tensor._scale(None, None, [inplace, inplace], s)  # clipping: grads scaled in place
    for a, b in zip(before, inplace):
        assert torch.equal(b, a * factor)


@pytest.mark.slow
def test_fused_adam_and_foreach_hooks_train_like_the_foreach_adam(clipped_proxy_runs):
    """Same proxy run with torch's fused AdamW and with its foreach AdamW (both with our
    _foreach norm/clip hooks, which the trainer installs on this machine: megatron has no
    TE/Apex here); a small clip_grad makes clipping act on every step. The two AdamW kernels
    differ only in fp32 rounding."""
    fused, foreach = clipped_proxy_runs("default"), clipped_proxy_runs("foreach")
    assert [r["step"] for r in fused] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0.05 for r in fused)  # clipping was active
    for a, b in zip(fused, foreach):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a, b)


@pytest.mark.slow
def test_deferred_grad_scaling_trains_like_the_separate_passes(clipped_proxy_runs):
    """optimizer.defer_grad_scaling (the 1/tokens scale and the clip coefficient applied inside the
    fused AdamW kernel) against megatron's two passes over the gradients, clipping active."""
    deferred, passes = clipped_proxy_runs("default"), clipped_proxy_runs("passes")
    assert all(r["grad_norm"] > 0.05 for r in deferred)
    for a, b in zip(deferred, passes):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-7), (a, b)
        # the deferred path takes the norm of the unscaled gradients and scales it once; the two
        # passes scale every element first: the same value up to fp32 summation rounding
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
        assert a["param_norm"] == pytest.approx(b["param_norm"], rel=1e-6), (a, b)


def test_deferred_scale_reaches_the_fused_adamw_and_the_hooks(monkeypatch):
    """The hooks and the AdamW step, in process: norm and clip see the deferred factor, the
    gradients in memory are untouched, and the update equals AdamW on pre-scaled gradients."""
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    grads = [torch.randn_like(t) for t in init]

    def adam(params):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)

    ref = [torch.nn.Parameter(t.clone()) for t in init]
    ref_opt = adam(ref)
    tokens, coeff = 40.0, torch.tensor([0.3])
    for p, gr in zip(ref, grads):
        p.grad = gr / tokens * coeff
    ref_opt.step()

    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = adam(params)
    for p, gr in zip(params, grads):
        p.grad = gr.clone()
    deferred = multi_tensor.DeferredGradScale([opt])
    monkeypatch.setattr(multi_tensor, "_DEFERRED", deferred)
    step = deferred.wrap_step(opt.step)
    deferred.defer(torch.tensor([1.0 / tokens]))
    norm, _ = multi_tensor._l2_norm(None, None, [[p.grad for p in params]], False)
    want = torch.linalg.vector_norm(torch.cat([gr.flatten() for gr in grads])) / tokens
    torch.testing.assert_close(norm[0], want, rtol=1e-6, atol=0)
    multi_tensor._clip_scale(None, None, [[p.grad for p in params]] * 2, coeff)
    assert all(torch.equal(p.grad, gr) for p, gr in zip(params, grads))  # folded, not applied
    step()
    for a, b in zip(params, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert deferred.scale is None and opt.grad_scale is None  # the step ended the deferral
    plain = [t.clone() for t in grads]
    multi_tensor._clip_scale(None, None, [plain, plain], coeff)  # nothing deferred: in place
    assert all(torch.equal(a, b * coeff) for a, b in zip(plain, grads))


def test_install_fills_megatrons_hooks_once():
    from megatron.core.optimizer import clip_grads

    multi_tensor.use_foreach_kernels()
    assert clip_grads.l2_norm_impl is multi_tensor._l2_norm
    assert clip_grads.multi_tensor_scale_tensor_impl is multi_tensor._clip_scale  # grad norm stays a tensor
    assert multi_tensor.use_foreach_kernels() is True  # idempotent


def test_use_fused_adam_switches_torch_adamw_groups():
    p = torch.nn.Parameter(torch.randn(4, 4))

    class Wrapped:  # megatron's optimizers keep the torch one as .optimizer
        optimizer = torch.optim.AdamW([p], lr=1e-3)

    chained = type("Chained", (), {"chained_optimizers": [Wrapped()]})()
    assert multi_tensor.use_fused_adam(chained) == 1
    group = Wrapped.optimizer.param_groups[0]
    assert group["fused"] and not group["foreach"]
    p.grad = torch.ones_like(p)
    Wrapped.optimizer.step()  # the fused CPU kernel runs
    assert multi_tensor.use_fused_adam(chained) == 0  # already fused


def test_defer_grad_scaling_installs_and_lets_the_optimizer_go():
    import gc
    import weakref

    multi_tensor.use_foreach_kernels()
    p = torch.nn.Parameter(torch.randn(4, 4))

    class Wrapped:  # megatron's optimizer keeps the torch one as .optimizer
        def __init__(self):
            self.optimizer = torch.optim.AdamW([p], lr=1e-3, fused=True)

        def step(self):
            self.optimizer.step()
            return True, None, None

    class Chunk:  # the DDP wrapper's scale_gradients is what megatron's finalize calls
        def scale_gradients(self, factor):
            raise AssertionError("should have been deferred")

    opt, chunk = Wrapped(), Chunk()
    deferred = multi_tensor.defer_grad_scaling(opt, [chunk])
    assert deferred is not None and multi_tensor._DEFERRED is deferred
    chunk.scale_gradients(torch.tensor([0.5]))  # finalize: recorded, not applied
    assert opt.optimizer.grad_scale.item() == 2.0
    p.grad = torch.ones_like(p)
    opt.step()
    assert deferred.scale is None and opt.optimizer.grad_scale is None
    unfused = Wrapped()
    unfused.optimizer.param_groups[0]["fused"] = False
    assert multi_tensor.defer_grad_scaling(unfused, [Chunk()]) is None  # megatron's passes stay
    gone = weakref.ref(opt.optimizer)
    multi_tensor.stop_deferring()  # end of training
    del opt, chunk, deferred
    gc.collect()
    assert multi_tensor._DEFERRED is None and gone() is None
