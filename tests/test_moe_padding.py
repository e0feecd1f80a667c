"""MoE under packing: padding tokens are kept out of routing, so the load-balancing aux loss
(and its gradient into the router) depends on the real tokens only, not on how much padding
a packed row or a padded batch carries."""

from __future__ import annotations

import torch

from data.collate import pack_thd, pad_bshd
from data.mock import MockDataset
from models import get_model_builder
from multimodal.config import load_config
from multimodal.forward_step import packed_seq_params
from core.seeding import seed_everything


def _router_grads(model, batch, with_mask: bool) -> dict:
    model.zero_grad(set_to_none=True)
    losses = model(batch["tokens"], batch["position_ids"], labels=batch["labels"], pixel_values=batch["pixel_values"],
                   image_grid_thw=batch["image_grid_thw"], packed_seq_params=packed_seq_params(batch),
                   padding_mask=batch["padding_mask"] if with_mask else None)
    (losses * batch["loss_mask"]).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if "router" in n}


def test_aux_loss_ignores_padding(mcore):
    cfg = load_config("configs/qwen35_vl_proxy_moe.yaml", ["model.moe_token_dispatcher=allgather",
                                                           "model.moe_aux_loss_coeff=0.1"])
    seed_everything(0)
    model = get_model_builder(cfg.model.name)(cfg.model, cfg.parallel, torch.float32)
    ds = MockDataset(cfg.model, cfg.data, 256)
    kw = dict(pad_id=cfg.model.pad_token_id, image_token_id=cfg.model.image_token_id,
              merge=cfg.model.vision.spatial_merge_size)
    samples = [ds[2], ds[3]]
    short, long = pack_thd(samples, 512, **kw), pack_thd(samples, 1024, pad_multiple=8, **kw)
    assert long["padding_mask"].sum() > short["padding_mask"].sum() + 400  # far more padding
    assert not short["padding_mask"][0, : len(samples[0]["input_ids"])].any()

    a, b = _router_grads(model, short, True), _router_grads(model, long, True)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7, msg=name)
    padded = pad_bshd(samples, 256, **kw)
    c = _router_grads(model, padded, True)
    for name in a:
        torch.testing.assert_close(a[name], c[name], rtol=1e-5, atol=1e-7, msg=name)
    # without the mask the padding is routed and counted: the router gradient changes
    d = _router_grads(model, long, False)
    assert any(not torch.allclose(a[n], d[n], rtol=1e-3, atol=1e-6) for n in a)
