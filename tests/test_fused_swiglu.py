"""model.fused_swiglu: the MLP's SwiGLU through megatron-core's fused function (one compiled
kernel per direction) against the plain chunk/silu/multiply path, on the proxy model."""

from __future__ import annotations

import pytest
import torch

from proxy_fixtures import PROXY, forward, packed_rows, proxy_model

from multimodal.config import load_config


def _loss_and_grads(fused: bool, calls: list):
    cfg, model = proxy_model([f"model.fused_swiglu={str(fused).lower()}"])
    assert model.config.bias_activation_fusion is fused
    batch = packed_rows(cfg)[0]
    before = len(calls)
    total = (forward(model, batch) * batch["loss_mask"]).sum()
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls) - before


@pytest.mark.slow  # compiles megatron's swiglu with Inductor on the CPU
def test_fused_swiglu_matches_the_plain_path(mcore, monkeypatch):
    from megatron.core.fusions import fused_bias_swiglu as fbs

    calls = []
    apply = fbs.SwiGLUFunction.apply

    def counting(*args):
        calls.append(1)
        return apply(*args)

    monkeypatch.setattr(fbs.SwiGLUFunction, "apply", counting)
    torch._dynamo.reset()
    plain_loss, plain_grads, plain_calls = _loss_and_grads(False, calls)
    fused_loss, fused_grads, fused_calls = _loss_and_grads(True, calls)
    assert plain_calls == 0 and fused_calls == load_config(PROXY).model.num_layers
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-5, atol=1e-5)
    for name, g in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=1e-4, atol=1e-5 * max(1.0, float(g.abs().max())),
                                   msg=name)
