"""Weight-gradient accumulation fusion (models/common/wgrad_fusion.py): the GEMM adds into
main_grad exactly what the unfused backward adds, through megatron's real linear layers."""

from __future__ import annotations

import torch
from proxy_fixtures import accumulate, packed_rows, proxy_model, wrap_ddp

from models.common import wgrad_fusion


def test_gemm_accumulates_into_main_grad():
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(40, 24, generator=gen), torch.randn(40, 16, generator=gen)
    acc = torch.randn(16, 24, generator=gen)
    want = acc + g.t() @ x
    wgrad_fusion.wgrad_gemm_accum_fp32(x, g, acc)
    torch.testing.assert_close(acc, want, rtol=1e-6, atol=1e-6)
    # bf16 activations into an fp32 buffer: the product is not rounded to bf16 first
    xb, gb = x.bfloat16(), g.bfloat16()
    acc2 = torch.zeros(16, 24)
    wgrad_fusion.wgrad_gemm_accum_fp32(xb, gb, acc2)
    torch.testing.assert_close(acc2, gb.float().t() @ xb.float(), rtol=1e-6, atol=1e-6)
    half = torch.zeros(16, 24, dtype=torch.bfloat16)
    wgrad_fusion.wgrad_gemm_accum_fp16(xb, gb, half)
    torch.testing.assert_close(half.float(), gb.float().t() @ xb.float(), rtol=1e-2, atol=1e-2)


def test_resolve_is_opt_in():
    assert wgrad_fusion.resolve(False) is False
    assert wgrad_fusion.resolve(None) is False  # measured slower on the H200: opt-in
    if not torch.cuda.is_available():
        assert wgrad_fusion.resolve(True) is True  # runs on the CPU too (the test below)


def _main_grads(ddp, model, batch):
    return accumulate(ddp, model, [batch])[1]


def test_fused_backward_matches_the_ddp_hook_path(mcore):
    cfg, model = proxy_model()
    m = cfg.model
    batch = packed_rows(cfg)[0]
    ddp = wrap_ddp(model)
    plain = _main_grads(ddp, model, batch)
    fused_layers = wgrad_fusion.enable(ddp)
    # every decoder linear: in_proj/out_proj (GDN), linear_qkv/linear_proj, linear_fc1/fc2
    assert fused_layers == 2 * m.num_layers + 2 * m.num_layers
    fused = _main_grads(ddp, model, batch)
    linear_weights = [n for n, p in model.named_parameters() if getattr(p, "grad_added_to_main_grad", False)]
    assert len(linear_weights) == fused_layers  # those took the fused path; their DDP hook skipped the add
    for name, g in plain.items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(fused[name], g, rtol=1e-5, atol=1e-7, msg=name)
