"""model.fused_swiglu: the MLP's SwiGLU through megatron-core's fused function (one compiled
kernel per direction) against the plain chunk/silu/multiply path, on the proxy model."""

from __future__ import annotations

import pytest
import torch

from data.collate import pack_thd
from data.mock import MockDataset
from models import get_model_builder
from multimodal.config import load_config
from multimodal.forward_step import packed_seq_params, to_device


def _loss_and_grads(fused: bool, calls: list):
    from multimodal.platform import seed_everything

    cfg = load_config("configs/qwen35_vl_proxy.yaml", [f"model.fused_swiglu={str(fused).lower()}"])
    seed_everything(0)
    model = get_model_builder(cfg.model.name)(cfg.model, cfg.parallel, torch.float32)
    assert model.config.bias_activation_fusion is fused
    m = cfg.model
    ds = MockDataset(m, cfg.data, 256)
    batch = to_device(pack_thd([ds[0], ds[1]], 384, m.pad_token_id, m.image_token_id, m.vision.spatial_merge_size),
                      torch.device("cpu"), torch.float32)
    before = len(calls)
    loss = model(batch["tokens"], batch["position_ids"], labels=batch["labels"], pixel_values=batch["pixel_values"],
                 image_grid_thw=batch["image_grid_thw"], packed_seq_params=packed_seq_params(batch))
    total = (loss * batch["loss_mask"]).sum()
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
    assert plain_calls == 0 and fused_calls == load_config("configs/qwen35_vl_proxy.yaml").model.num_layers
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-5, atol=1e-5)
    for name, g in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=1e-4, atol=1e-5 * max(1.0, float(g.abs().max())),
                                   msg=name)
