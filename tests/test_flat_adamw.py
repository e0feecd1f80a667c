"""Flat AdamW (fused_kernels/flat_adamw.py, multimodal/performance/flat_adamw_patch.py) against torch's AdamW: the Triton
kernel (interpreter) and its PyTorch reference on raw buffers, then the layout inside megatron's
optimizer on the proxy model, a state-dict round trip, and the trainer end to end."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from fused_kernels.flat_adamw import CHUNK, chunk_table, flat_adamw
from helpers.proxy_fixtures import proxy_model, wrap_ddp

HP = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
SEGMENTS = [(0, 100), (128, 5000), (5184, 2 * CHUNK + 7)]  # padding between, one spans three chunks

_KERNEL_CHECK = r"""
import json, torch
from fused_kernels.flat_adamw import chunk_table, flat_adamw
segs, hp = json.loads(SEGS), json.loads(HP)
torch.manual_seed(0)
n = segs[-1][0] + segs[-1][1] + 32
result = {}
for layout in ("same", "packed"):  # state at the gradient's index, or packed densely (a DP shard)
    table, pos = [], 0
    for s0, k in segs:
        table.append((s0, s0 if layout == "same" else pos, k))
        pos += k
    ns = n if layout == "same" else pos
    p, m = torch.randn(ns), torch.randn(ns) * 1e-3
    v = torch.rand(ns) * 1e-4
    ref = [t.clone() for t in (p, m, v)]
    out = torch.full((n,), 7.0, dtype=torch.bfloat16)
    ref_out = out.clone()
    starts, state_starts, lengths = chunk_table(table, "cpu")
    scale = torch.tensor([0.5])
    zero = layout == "packed"  # optimizer.overlap_step: the kernel zeroes the gradients it read
    for step in (1, 2, 3):
        g = torch.randn(n)
        g_ref = g.clone()
        flat_adamw(p, g, m, v, out, starts, state_starts, lengths, weight_decay=0.1, step=step, grad_scale=scale,
                   zero_grad=zero, **hp)
        flat_adamw(ref[0], g_ref, ref[1], ref[2], ref_out, starts, state_starts, lengths, weight_decay=0.1, step=step,
                   grad_scale=scale, zero_grad=zero, use_kernel=False, **hp)
        if zero:
            assert torch.equal(g, g_ref)
    seg = torch.zeros(n, dtype=torch.bool)
    for s0, k in segs:
        seg[s0:s0 + k] = True
    p_at_out = torch.zeros(n)
    for s0, ss, k in table:
        p_at_out[s0:s0 + k] = p[ss:ss + k]
    result[layout] = {"param": (p - ref[0]).abs().max().item(), "m": (m - ref[1]).abs().max().item(),
                      "v": (v - ref[2]).abs().max().item(),
                      "out_vs_param": ((out.float() - p_at_out) / p_at_out.abs())[seg].abs().max().item(),
                      "out_vs_reference": (out.float() - ref_out.float())[seg].abs().max().item(),
                      "padding_untouched": bool((out[100:128] == 7).all() and (out[~seg] == 7).all()),
                      "grad_zeroed": bool(not g[seg].any()), "grad_padding_kept": bool(g[~seg].all())}
print(json.dumps(result))
"""


def test_triton_kernel_matches_its_reference_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", SEGS=json.dumps(SEGMENTS), HP=json.dumps(HP))
    code = "import os; SEGS, HP = os.environ['SEGS'], os.environ['HP']\n" + _KERNEL_CHECK
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env={**env, "PYTHONPATH": root},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for layout, got in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        assert got["param"] < 1e-6 and got["m"] < 1e-9 and got["v"] < 1e-10, (layout, got)
        # the bf16 copy is the fp32 parameter within one bf16 ulp (the interpreter's cast may
        # truncate; on the GPU scripts/bench_adamw.py checks it against torch's rounding)
        assert got["out_vs_param"] <= 2.0 ** -7, (layout, got)
        assert got["out_vs_reference"] <= 0.05, (layout, got)  # written where the reference writes
        assert got["padding_untouched"], (layout, got)
        # only where it updated, and only when asked
        assert got["grad_zeroed"] == (layout == "packed") and got["grad_padding_kept"], (layout, got)


def test_reference_equals_torch_adamw_per_parameter():
    """Two groups (decay / no decay), a grad_scale, three steps: the flat update over segments of
    one buffer equals torch.optim.AdamW over the same parameters as separate tensors."""
    torch.manual_seed(0)
    n = SEGMENTS[-1][0] + SEGMENTS[-1][1]
    flat = torch.randn(n)
    m, v = torch.zeros(n), torch.zeros(n)
    params = [torch.nn.Parameter(flat[s:s + k].clone()) for s, k in SEGMENTS]
    adam = torch.optim.AdamW([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}],
                             lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], foreach=False)
    scale = torch.tensor([4.0])
    adam.grad_scale = scale  # torch's AdamW divides by it like the fused kernel (CPU fused path)
    for g in adam.param_groups:
        g["fused"] = True
    tables = [chunk_table(SEGMENTS[:2], "cpu"), chunk_table(SEGMENTS[2:], "cpu")]
    for step in (1, 2, 3):
        grad = torch.randn(n)
        for p, (s, k) in zip(params, SEGMENTS):
            p.grad = grad[s:s + k].clone()
        adam.step()
        for (starts, state_starts, lengths), wd in zip(tables, (0.1, 0.0)):
            flat_adamw(flat, grad, m, v, None, starts, state_starts, lengths, weight_decay=wd, step=step, grad_scale=scale,
                       use_kernel=False, **HP)
    for p, (s, k) in zip(params, SEGMENTS):
        torch.testing.assert_close(flat[s:s + k], p.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(m[s:s + k], adam.state[p]["exp_avg"], rtol=1e-6, atol=1e-7)  # torch lerps


def _megatron_optimizer(flat: bool, bf16_cuda: bool = False):
    """megatron's optimizer over the proxy model: FP32Optimizer on the CPU, or (``bf16_cuda``) bf16
    parameters on the GPU with fp32 main parameters (Float16OptimizerWithFloat16Params)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from multimodal.performance import flat_adamw_patch as flat_mod, multi_tensor

    cfg, model = proxy_model()
    if bf16_cuda:
        model = model.to("cuda", torch.bfloat16)
    elif torch.cuda.is_available():  # megatron puts the gradient buffers on the GPU when there is one
        model = model.cuda()
    ddp = wrap_ddp(model)
    multi_tensor.use_foreach_kernels()
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=0.0,
                                                 bf16=bf16_cuda, params_dtype=torch.bfloat16 if bf16_cuda else torch.float32),
                                 [ddp])
    multi_tensor.use_fused_adam(opt)
    for group in opt.optimizer.param_groups:  # what the trainer's scheduler sets each step
        group["weight_decay"] = 0.1 * group["wd_mult"]
    installed = flat_mod.use_flat_adamw(opt, [ddp], True) if flat else []
    assert len(installed) == (1 if flat else 0)
    return model, ddp, opt, installed


def _step(model, ddp, opt, seed):
    g = torch.Generator().manual_seed(seed)
    ddp.zero_grad_buffer()
    for _, p in sorted(model.named_parameters()):
        p.main_grad.copy_(torch.randn(p.shape, generator=g))
    opt.step()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: bf16 parameters need megatron's CUDA optimizer")
def test_bf16_model_params_are_written_by_the_kernel_on_gpu(mcore):
    """The Triton kernel under megatron's Float16 optimizer: the bf16 model parameters it writes
    equal megatron's copy of the fp32 main parameters after torch's fused AdamW, and a later
    explicit copy (what a checkpoint load triggers) still runs."""
    ref_model, ref_ddp, ref_opt, _ = _megatron_optimizer(flat=False, bf16_cuda=True)
    model, ddp, opt, (flat,) = _megatron_optimizer(flat=True, bf16_cuda=True)
    assert flat.use_kernel and any(fb.out is not None for fb in flat.flat.values())
    for seed in (1, 2, 3):
        _step(ref_model, ref_ddp, ref_opt, seed)
        _step(model, ddp, opt, seed)
    for (name, a), (_, b) in zip(sorted(model.named_parameters()), sorted(ref_model.named_parameters())):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.main_param, b.main_param, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(a, a.main_param.bfloat16(), rtol=0, atol=0, msg=name)  # written this step
    p = next(model.parameters())
    p.main_param.add_(1.0)
    (inner,) = getattr(opt, "chained_optimizers", [opt])
    inner._copy_main_params_to_model_params()  # not right after a step: megatron's copy runs
    torch.testing.assert_close(p, p.main_param.bfloat16(), rtol=0, atol=0)


def test_megatron_optimizer_with_flat_buffers_steps_like_torch_adamw(mcore):
    ref_model, ref_ddp, ref_opt, _ = _megatron_optimizer(flat=False)
    model, ddp, opt, (flat,) = _megatron_optimizer(flat=True)
    adam = opt.optimizer
    assert len({g["weight_decay"] for g in adam.param_groups}) == 2  # decay and no-decay groups both run
    (fb,) = flat.flat.values()
    for p in model.parameters():  # parameters are views of the flat buffer
        assert p.untyped_storage().data_ptr() == fb.main.untyped_storage().data_ptr()
    # the moments come at the first step, as torch's: the first step's transients (graph capture)
    # must not stack on them
    assert fb.exp_avg is None and not any(adam.state.values())
    for seed in (1, 2, 3):
        _step(ref_model, ref_ddp, ref_opt, seed)
        _step(model, ddp, opt, seed)
    assert flat.count == 3 and float(adam.state[next(iter(adam.state))]["step"]) == 3.0
    # On the CPU the two agree to 1e-7. On the GPU torch's kernel and ours round differently (on an
    # H200 this comparison missed 1e-7 while our kernel still used Triton's approximate sqrt and
    # division; the bf16 one below passed at 1e-6). A real error (a missed weight decay or gradient
    # scale) moves parameters by ~1e-4 here, so 1e-6 still catches it.
    atol = 1e-6 if torch.cuda.is_available() else 1e-7
    for (name, a), (_, b) in zip(sorted(model.named_parameters()), sorted(ref_model.named_parameters())):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
    for a, b in zip(adam.param_groups, ref_opt.optimizer.param_groups):
        assert all(adam.state[p]["exp_avg"].untyped_storage().data_ptr() == fb.exp_avg.untyped_storage().data_ptr()
                   for p in a["params"])
        for p, q in zip(a["params"], b["params"]):
            torch.testing.assert_close(adam.state[p]["exp_avg_sq"], ref_opt.optimizer.state[q]["exp_avg_sq"],
                                       rtol=1e-5, atol=1e-12)


def test_state_dict_round_trip_rebinds_the_flat_buffers(mcore):
    """A checkpoint of a flat run loads into a fresh flat run (torch's load_state_dict installs new
    moment tensors; the hook copies them into the flat buffers) and the next step continues the
    same trajectory as the run that was not interrupted."""
    model, ddp, opt, _ = _megatron_optimizer(flat=True)
    for seed in (1, 2):
        _step(model, ddp, opt, seed)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _step(model, ddp, opt, 3)

    model2, ddp2, opt2, (flat2,) = _megatron_optimizer(flat=True)
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    assert flat2.count == 2
    (fb,) = flat2.flat.values()
    for state in opt2.optimizer.state.values():
        assert state["exp_avg"].untyped_storage().data_ptr() == fb.exp_avg.untyped_storage().data_ptr()
        assert state["step"] is flat2.step_tensor
    _step(model2, ddp2, opt2, 3)
    for (name, a), (_, b) in zip(sorted(model2.named_parameters()), sorted(model.named_parameters())):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8, msg=name)


def test_install_refuses_what_it_does_not_cover(mcore, caplog):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from multimodal.performance import flat_adamw_patch as flat_mod

    _, model = proxy_model()
    ddp = wrap_ddp(model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=1e-2, bf16=False,
                                                 params_dtype=torch.float32), [ddp])
    with caplog.at_level("INFO"):
        assert flat_mod.use_flat_adamw(opt, [ddp], True) == []
    assert "not AdamW" in caplog.text
    assert flat_mod.use_flat_adamw(opt, [ddp], False) == []


@pytest.mark.slow
def test_trainer_with_flat_adamw_trains_like_torch_fused(clipped_proxy_runs):
    """The entry point with optimizer.flat=true (the PyTorch reference on this CPU) against torch's
    fused AdamW, clipping active (so the deferred grad_scale reaches the flat step)."""
    flat, fused = clipped_proxy_runs("flat"), clipped_proxy_runs("not_flat")
    assert all(r["grad_norm"] > 0.05 for r in flat)
    for a, b in zip(flat, fused):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), (a, b)
        assert a["param_norm"] == pytest.approx(b["param_norm"], rel=1e-6), (a, b)
