"""Fused MRoPE, pre-GDR and SwiGLU kernels: references against independent formulas (in process), and
the Triton kernels against the references under the Triton interpreter (in a subprocess).

The interpreter is chosen when a ``@triton.jit`` function is defined, i.e. when the kernel
module is imported; other test modules import it normally (through the model), so the
Triton cases run in a fresh process with TRITON_INTERPRET=1, through the same harness the
GPU check uses (tests/gpu/test_fused_kernels_gpu.py --small).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fused_kernels import fused_mrope as fm
from fused_kernels import fused_pre_gdr as fp
from fused_kernels.rotary import inverse_frequencies

ROOT = Path(__file__).resolve().parents[1]
from gpu import test_fused_kernels_gpu as harness  # tests/ is on sys.path (conftest)


# ----------------------------------------------------------------------------- Triton (interpreter)


@pytest.fixture(scope="module")
def interp_runs():
    """Both interpreter subprocesses, started together (they take most of this file's time)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    cmds = {
        "parity": [sys.executable, str(ROOT / "tests" / "gpu" / "test_fused_kernels_gpu.py"), "--small", "--device", "cpu",
                   "--json", "-"],
        "model": [sys.executable, str(ROOT / "tests" / "test_fused_kernels.py"), "model-check"],
    }
    procs = {k: subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for k, c in cmds.items()}
    out = {}
    for k, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        lines = [ln for ln in stdout.splitlines() if ln.startswith(("[", "{"))]
        assert lines, f"{k}: no results (rc {proc.returncode}):\n{stderr[-3000:]}"
        out[k] = json.loads(lines[-1])
    return out


@pytest.fixture(scope="module")
def interpreted(interp_runs):
    return interp_runs["parity"]


@pytest.mark.parametrize("kernel,expected", [("mrope", 19), ("mrope_pair", 2), ("rotary_qkv", 3), ("pre_gdr", 6), ("swiglu", 5)])
def test_triton_kernels_match_reference_under_interpreter(interpreted, kernel, expected):
    cases = [r for r in interpreted if r["kernel"] == kernel]
    assert len(cases) == expected  # every case ran (none skipped)
    bad = [f"{r['case']}: {r['errs']}" for r in cases if not r["ok"]]
    assert not bad, "\n".join(bad)
    # every output and gradient was compared, and fp32 matched to rounding
    n_outputs = {"mrope": 2, "mrope_pair": 4, "rotary_qkv": 4, "pre_gdr": 11, "swiglu": 2}[kernel]
    assert all(len(r["errs"]) == n_outputs - ("without k" in r["case"]) for r in cases)
    assert all(max(r["errs"].values()) < 1e-6 for r in cases if r["dtype"] == "fp32")


def test_harness_flags_a_wrong_kernel():
    """The parity harness must fail on a kernel that is slightly wrong (angle off by one position)."""
    inv = inverse_frequencies(64, 1e7)
    pos = torch.randint(0, 100, (3, 2, 5))
    x = torch.randn(2, 5, 2, 256)
    errs, ok = harness._compare(
        "mrope", lambda x: fm.mrope_reference(x, pos + 1, inv, [11, 11, 10]),
        lambda x: fm.mrope_reference(x, pos, inv, [11, 11, 10]), [(x, False)], torch.float32)
    assert ok and max(errs.values()) > harness.TOL["bf16"]


# ----------------------------------------------------------------------------- mRoPE reference


def _rope_1d(x, pos, inv):
    """Ordinary rotate-half RoPE on the first 2*len(inv) channels, written out independently."""
    half = inv.numel()
    ang = (pos.float()[..., None] * inv).double()  # [B, S, half]; the angle itself is an fp32 product
    c, s = ang.cos()[:, :, None], ang.sin()[:, :, None]
    x1, x2, rest = x[..., :half].double(), x[..., half:2 * half].double(), x[..., 2 * half:].double()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


def test_mrope_reference_is_rope_for_text_tokens():
    inv = inverse_frequencies(64, 1e7)
    pos1 = torch.randint(0, 5000, (2, 9))
    x = torch.randn(2, 9, 3, 256)
    out = fm.mrope_reference(x, pos1.expand(3, 2, 9), inv, [11, 11, 10])
    torch.testing.assert_close(out.double(), _rope_1d(x, pos1, inv), atol=2e-5, rtol=0)


def test_mrope_reference_interleaves_axes():
    """Frequency 3j+1 reads the height position, 3j+2 the width, the rest the temporal one."""
    inv = inverse_frequencies(64, 1e7)
    pos = torch.randint(0, 5000, (3, 1, 4))
    x = torch.randn(1, 4, 1, 256)
    out = fm.mrope_reference(x, pos, inv, [11, 11, 10])
    axis = [1 if (i % 3 == 1 and i < 33) else 2 if (i % 3 == 2 and i < 30) else 0 for i in range(32)]
    for i, a in enumerate(axis):  # a single frequency pair rotates by its own axis' angle
        ang = (pos[a, 0].float() * inv[i]).double()
        want1 = x[0, :, 0, i].double() * ang.cos() - x[0, :, 0, 32 + i].double() * ang.sin()
        torch.testing.assert_close(out[0, :, 0, i].double(), want1, atol=2e-5, rtol=0)
    torch.testing.assert_close(out[..., 64:], x[..., 64:])  # pass-through untouched


def test_mrope_reference_layouts_agree():
    inv = inverse_frequencies(8, 1e7)
    pos = torch.randint(0, 100, (3, 2, 6))
    x = torch.randn(2, 6, 3, 32)
    ref = fm.mrope_reference(x, pos, inv, [2, 1, 1])
    sbhd = fm.mrope_reference(x.transpose(0, 1), pos, inv, [2, 1, 1], layout="sbhd")
    torch.testing.assert_close(sbhd.transpose(0, 1), ref)
    thd = fm.mrope_reference(x[1], pos[:, 1], inv, [2, 1, 1], layout="thd")
    torch.testing.assert_close(thd, ref[1])


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_ranks_cover_the_sequence(cp):
    """Rank r holds chunks r and 2cp-1-r of every sample; together the ranks hold every token once,
    and each rank's zigzag-mode result equals the full-sequence result at its tokens."""
    lens = [4 * cp, 2 * cp, 6 * cp]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    idx = [fm.zigzag_global_index(cu, cp, r) for r in range(cp)]
    assert sorted(torch.cat(idx).tolist()) == list(range(sum(lens)))
    c = lens[0] // (2 * cp)
    assert idx[0][:c].tolist() == list(range(c))  # rank 0 starts with the first chunk ...
    assert idx[0][c:2 * c].tolist() == list(range((2 * cp - 1) * c, 2 * cp * c))  # ... then the last
    inv = inverse_frequencies(64, 1e7)
    pos = torch.randint(0, 1000, (3, 1, sum(lens)))
    x_full = torch.randn(sum(lens), 2, 256)
    full = fm.mrope_reference(x_full, pos, inv, [11, 11, 10], layout="thd")
    for r in range(cp):
        local = fm.mrope_reference(x_full[idx[r]], pos, inv, [11, 11, 10], layout="thd", cu_seqlens=cu,
                                   cp_size=cp, cp_rank=r)
        torch.testing.assert_close(local, full[idx[r]])


def test_check_zigzag_rejects_indivisible_lengths():
    fm.check_zigzag(torch.tensor([0, 8, 12]), 2)
    with pytest.raises(ValueError, match="divisible by 2\\*cp=4"):
        fm.check_zigzag(torch.tensor([0, 8, 14]), 2)


def test_fused_unavailable_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "CUDA" in fm.available(torch.zeros(1, 1, 1, 4), "sbhd")
    assert "CUDA" in fp.available(torch.zeros(1, 1, 8), torch.zeros(8, 4), 1, 1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "dtype" in fm.available(torch.zeros(1, 1, 1, 4, dtype=torch.float64), "sbhd")
    assert "kernel size" in fp.available(torch.zeros(1, 1, 8), torch.zeros(8, 3), 1, 1)


# ----------------------------------------------------------------------------- pre-GDR reference


def _pre_gdr_naive(qkv, b, a, w, a_log, dt, starts, nk, K, V):
    """Token-by-token loops: conv taps inside the sample, SiLU, per-head l2 norm, gates."""
    B, S, C = qkv.shape
    nv = b.shape[-1]
    u = torch.zeros(B, S, C, dtype=torch.float64)
    for t in range(S):
        for i in range(4):
            if t - i >= starts[t]:
                u[:, t] += w[:, 3 - i].double() * qkv[:, t - i].double()
    y = u * torch.sigmoid(u)
    q, k, v = y[..., :nk * K], y[..., nk * K:2 * nk * K], y[..., 2 * nk * K:]
    q, k = (z.reshape(B, S, nk, K) for z in (q, k))
    q, k = (z / torch.sqrt((z * z).sum(-1, keepdim=True) + 1e-6) for z in (q, k))
    rep = nv // nk
    q, k = (torch.stack([z[:, :, h // rep] for h in range(nv)], dim=2) for z in (q, k))
    g = -a_log.double().exp() * torch.log1p((a.double() + dt.double()).exp())
    return q, k, v.reshape(B, S, nv, V), g, torch.sigmoid(b.double())


@pytest.mark.parametrize("lens,B", [(None, 2), ([3, 1, 9], 1)])
def test_pre_gdr_reference_matches_token_loop(lens, B):
    gen = torch.Generator().manual_seed(3)
    nk, nv, K, V = 2, 4, 8, 4
    S = sum(lens) if lens else 7
    C = 2 * nk * K + nv * V
    qkv, b, a = (torch.randn(B, S, n, generator=gen) for n in (C, nv, nv))
    w, a_log, dt = torch.randn(C, 4, generator=gen), torch.randn(nv, generator=gen), torch.randn(nv, generator=gen)
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    starts = [0] * S if lens is None else [s for s, n in zip(cu.tolist(), lens) for _ in range(n)]
    got = fp.pre_gdr_reference(qkv, b, a, w, a_log, dt, cu, nk, K, V)
    want = _pre_gdr_naive(qkv, b, a, w, a_log, dt, starts, nk, K, V)
    for x, y in zip(got, want):
        torch.testing.assert_close(x.double(), y, atol=1e-5, rtol=1e-5)
    assert got[3].dtype == torch.float32 and got[0].is_contiguous()


# ----------------------------------------------------------------------------- model wiring


def _proxy_loss_and_grads(overrides):
    """Loss and parameter gradients of the proxy on one packed row (fixed seed and data)."""
    from data.collate import pack_thd
    from data.mock import MockDataset
    from models import get_model_builder
    from multimodal.config import load_config
    from multimodal.forward_step import packed_seq_params
    from core.seeding import seed_everything

    # one GDN and one attention layer, one small image: the interpreter runs every kernel op in numpy
    cfg = load_config(str(ROOT / "configs/qwen35_vl_proxy.yaml"),
                      ["model.num_layers=2", "model.full_attention_interval=2", "data.mock.max_text_tokens=24",
                       "data.mock.max_images=1", "data.mock.max_image_side=32", *overrides])
    seed_everything(0)
    model = get_model_builder(cfg.model.name)(cfg.model, cfg.parallel, torch.float32)
    m = cfg.model
    ds = MockDataset(m, cfg.data, 48)
    batch = pack_thd([ds[0], ds[1]], 96, pad_id=m.pad_token_id, image_token_id=m.image_token_id,
                     merge=m.vision.spatial_merge_size)
    loss = model(batch["tokens"], batch["position_ids"], labels=batch["labels"], pixel_values=batch["pixel_values"],
                 image_grid_thw=batch["image_grid_thw"], packed_seq_params=packed_seq_params(batch))
    total = (loss * batch["loss_mask"]).sum()
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _model_check() -> dict:
    """Run in a subprocess with TRITON_INTERPRET=1: the proxy with both fused kernels vs without."""
    from megatron.core import parallel_state as ps

    from multimodal.platform import init_distributed

    init_distributed()
    ps.initialize_model_parallel(1, 1)
    from fused_kernels import fused_swiglu as fs

    calls = {"mrope": 0, "mrope_pair": 0, "rotary_qkv": 0, "pre_gdr": 0, "pre_gdr_proj": 0, "swiglu": 0}
    real_mrope, real_pre, real_swiglu = fm.fused_mrope, fp.fused_pre_gdr, fs.swiglu
    real_rotary_qkv, real_pair = fm.rotary_qkv, fm.fused_mrope_pair
    real_pre_proj = fp.fused_pre_gdr_from_proj

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    fm.fused_mrope, fp.fused_pre_gdr = count("mrope", real_mrope), count("pre_gdr", real_pre)
    fp.fused_pre_gdr_from_proj = count("pre_gdr_proj", real_pre_proj)
    fm.rotary_qkv = count("rotary_qkv", real_rotary_qkv)
    fm.fused_mrope_pair = count("mrope_pair", real_pair)
    fs.swiglu = count("swiglu", real_swiglu)
    loss_f, grads_f = _proxy_loss_and_grads(["model.fused_mrope=true", "model.gdn_pre_impl=fused",
                                             "model.fused_swiglu=true"])
    loss_u, grads_u = _proxy_loss_and_grads(["model.fused_mrope=false", "model.gdn_pre_impl=unfused",
                                             "model.fused_swiglu=false"])
    errs = {n: ((grads_f[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item() for n, g in grads_u.items()}
    return dict(calls=calls, loss_fused=loss_f.item(), loss_unfused=loss_u.item(), grad_rel=errs,
                same_params=sorted(grads_f) == sorted(grads_u))


def test_model_runs_both_fused_kernels_and_matches_the_pytorch_path(interp_runs):
    r = interp_runs["model"]
    # mRoPE: q and k as one pair in the attention layer; each of the 2 vision blocks splits and
    # rotates its projection through rotary_qkv; pre-GDR: the GDN layer, through the
    # whole-projection entry (no split outside it); SwiGLU: both layers' MLPs (megatron's MLP)
    assert r["calls"] == {"mrope": 0, "mrope_pair": 1, "rotary_qkv": 2, "pre_gdr": 0, "pre_gdr_proj": 1, "swiglu": 2}
    assert r["same_params"]
    assert abs(r["loss_fused"] - r["loss_unfused"]) <= 1e-5 * abs(r["loss_unfused"])
    # A_log / dt_bias sum dg over tokens through the delta rule: ulp-level changes in g add up there
    loose = {n: e for n, e in r["grad_rel"].items() if n.endswith(("A_log", "dt_bias"))}
    tight = {n: e for n, e in r["grad_rel"].items() if n not in loose}
    assert max(tight.values()) < 1e-4, tight
    assert max(loose.values()) < 5e-3, loose


def test_fused_requested_on_cpu_falls_back_with_one_warning(mcore, monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fm.warn_fallback.cache_clear()
    fp.warn_fallback.cache_clear()
    with caplog.at_level("WARNING"):
        loss_f, grads_f = _proxy_loss_and_grads(["model.fused_mrope=true", "model.gdn_pre_impl=fused"])
        _proxy_loss_and_grads(["model.fused_mrope=true", "model.gdn_pre_impl=fused"])
    loss_u, grads_u = _proxy_loss_and_grads(["model.fused_mrope=false", "model.gdn_pre_impl=unfused"])
    msgs = [r.getMessage() for r in caplog.records if "requested but not used" in r.getMessage()]
    assert len(msgs) == 2 and all("not on a CUDA device" in m for m in msgs), msgs  # one per kernel
    assert torch.equal(loss_f, loss_u)  # the same PyTorch ops, so the same bits
    assert all(torch.equal(grads_f[n], g) for n, g in grads_u.items())


def test_auto_resolves_to_pytorch_on_cpu(mcore):
    from models.qwen35_vl.gdn import Qwen35GatedDeltaNet

    from models import get_model_builder
    from multimodal.config import load_config

    from models.qwen35_vl.model import FUSED_KERNELS_BY_DEFAULT
    from core.seeding import seed_everything

    cfg = load_config(str(ROOT / "configs/qwen35_vl_proxy.yaml"), ["model.num_layers=2", "model.full_attention_interval=2"])
    assert cfg.model.fused_mrope is None and cfg.model.gdn_pre_impl == "auto"
    seed_everything(0)
    model = get_model_builder(cfg.model.name)(cfg.model, cfg.parallel, torch.float32)
    fused = torch.cuda.is_available() and FUSED_KERNELS_BY_DEFAULT
    assert model.language_model.fused_mrope is fused
    assert Qwen35GatedDeltaNet.gdn_pre_impl == ("fused" if fused else "unfused")


if __name__ == "__main__" and sys.argv[1:] == ["model-check"]:
    print(json.dumps(_model_check()))
