"""fused_pre_gdr_from_proj (the whole in_proj output in, one gradient tensor out) against the
fused path on torch.split views and against pre_gdr_reference.

The Triton kernels run under the interpreter, chosen when the kernel module is imported; other
test modules import it normally, so the cases run in a subprocess with TRITON_INTERPRET=1 (as in
test_fused_kernels.py) and report one failure message (or None) per case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# name: (dtype, B, S, nk, nv, K, V, packed sample lengths or None, z used by the loss)
CASES = {
    "dense fp32": ("fp32", 2, 11, 2, 4, 16, 8, None, True),
    "dense fp32 z unused": ("fp32", 2, 11, 2, 4, 16, 8, None, False),
    "packed fp32": ("fp32", 1, 19, 2, 2, 8, 8, [5, 1, 2, 11], True),
    "packed fp32 z unused": ("fp32", 1, 19, 2, 2, 8, 8, [5, 1, 2, 11], False),
    "packed fp32 empty samples": ("fp32", 1, 40, 1, 2, 16, 8, [0, 7, 1, 0, 32], True),
    "packed bf16": ("bf16", 1, 13, 1, 2, 16, 16, [6, 7], True),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(dtype, B, S, nk, nv, K, V, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = 2 * nk * K + nv * V
    D = C + nv * V + 2 * nv
    proj = torch.randn(S, B, D, generator=g).to(dtype)  # megatron's [S, B, D] in_proj output
    w = (torch.randn(C, 4, generator=g) * 0.5).to(dtype)
    a_log = torch.rand(nv, generator=g) * 2 - 1  # fp32, as the model keeps them
    dt = torch.randn(nv, generator=g)
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return proj, w, a_log, dt, cu


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _run_case(dtype_name, B, S, nk, nv, K, V, lens, z_used):
    from fused_kernels import fused_pre_gdr as fp

    dtype = DTYPES[dtype_name]
    proj0, w0, a_log0, dt0, cu = _inputs(dtype, B, S, nk, nv, K, V, lens)
    C, vd = 2 * nk * K + nv * V, nv * V
    g = torch.Generator().manual_seed(1)
    names = ["q", "k", "v", "g", "beta", "z"]

    # new: the whole [B, S, D] view in
    proj, w, a_log, dt = _leaves(proj0, w0, a_log0, dt0)
    new = fp.fused_pre_gdr_from_proj(proj.transpose(0, 1), w, a_log, dt, cu, nk, K, V, nv)
    cots = [torch.randn(o.shape, generator=g).to(o.dtype) for o in new]
    n_out = 6 if z_used else 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        new_grads = torch.autograd.grad(new[:n_out], [proj, w, a_log, dt], cots[:n_out])
    new_ops = {e.name for e in prof.events()}

    # old: torch.split views into fused_pre_gdr (what _prepare_fused did)
    proj_o, w_o, a_log_o, dt_o = _leaves(proj0, w0, a_log0, dt0)
    qkv, z, b, a = torch.split(proj_o.transpose(0, 1), [C, vd, nv, nv], dim=-1)
    old = (*fp.fused_pre_gdr(qkv, b, a, w_o, a_log_o, dt_o, cu, nk, K, V), z)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        old_grads = torch.autograd.grad(old[:n_out], [proj_o, w_o, a_log_o, dt_o], cots[:n_out])
    old_ops = {e.name for e in prof.events()}

    # the same kernels on the same inputs: every output and gradient to the bit
    for n, x, y in zip(names, new, old):
        assert x.shape == y.shape and x.dtype == y.dtype, (n, x.shape, y.shape, x.dtype, y.dtype)
        assert torch.equal(x, y), f"output {n} differs from the split path"
    for n, x, y in zip(["proj", "conv_w", "A_log", "dt_bias"], new_grads, old_grads):
        assert torch.equal(x, y), f"d_{n} differs from the split path: {(x.float() - y.float()).abs().max()}"
    dproj = new_grads[0]
    if not z_used:
        assert torch.equal(dproj[..., C:C + vd], torch.zeros_like(dproj[..., C:C + vd])), "dz columns not zero"
    else:
        assert torch.equal(dproj[..., C:C + vd], cots[5].transpose(0, 1)), "dz columns are not z's gradient"
    # z is proj's memory, not a copy; the gradient reaches in_proj contiguous in its [S, B, D] layout
    z_new = new[5]
    assert z_new._base is proj and z_new.data_ptr() == proj[:, :, C:].data_ptr(), "z is not a view of proj"
    assert dproj.is_contiguous(), f"d_proj strides {dproj.stride()}"
    # the point of the function: no cat in its backward (the split path's backward has one)
    assert "aten::cat" in old_ops, "sanity: the split path's backward should cat"
    assert "aten::cat" not in new_ops, "a cat ran in the backward of fused_pre_gdr_from_proj"

    # against the PyTorch reference (fp32 cases: a different op order, so rounding-level tolerance)
    if dtype == torch.float32:
        proj_r, w_r, a_log_r, dt_r = _leaves(proj0, w0, a_log0, dt0)
        qkv, z, b, a = torch.split(proj_r.transpose(0, 1), [C, vd, nv, nv], dim=-1)
        ref = (*fp.pre_gdr_reference(qkv, b, a, w_r, a_log_r, dt_r, cu, nk, K, V), z)
        ref_grads = torch.autograd.grad(ref[:n_out], [proj_r, w_r, a_log_r, dt_r], cots[:n_out])
        for n, x, y in zip(names, new, ref):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{n} vs reference: {m}")
        for n, x, y in zip(["proj", "conv_w", "A_log", "dt_bias"], new_grads, ref_grads):
            # relative to the tensor's scale: the parameter gradients are sums over every token
            scale = y.abs().max().clamp_min(1e-12)
            err = ((x - y).abs().max() / scale).item()
            assert err < 2e-5, f"d_{n} vs reference: relative error {err}"


def _check_all() -> dict:
    out = {}
    for name, case in CASES.items():
        try:
            _run_case(*case)
            out[name] = None
        except AssertionError as e:
            out[name] = str(e) or repr(e)
    from fused_kernels import fused_pre_gdr as fp

    try:  # a width that is not qkv | z | b | a for these head counts is refused
        fp.fused_pre_gdr_from_proj(torch.zeros(1, 4, 10), torch.zeros(8, 4), torch.zeros(1), torch.zeros(1), None,
                                   1, 4, 4, 1)
        out["wrong width"] = "no error"
    except ValueError:
        out["wrong width"] = None
    return out


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "check"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no results (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("case", [*CASES, "wrong width"])
def test_from_proj_matches_split_path_and_reference(results, case):
    assert case in results
    assert results[case] is None, results[case]


if __name__ == "__main__" and sys.argv[1:] == ["check"]:
    print(json.dumps(_check_all()))
