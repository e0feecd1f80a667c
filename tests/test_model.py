"""Model registry, forward/backward of the dense and MoE proxies, packed-sample isolation."""

from __future__ import annotations

import pytest
import torch

from data.collate import pack_thd, pad_bshd
from data.mock import MockDataset
from models import MODEL_REGISTRY, get_model_builder
from multimodal.config import load_config
from multimodal.forward_step import packed_seq_params


def _build(cfg_path, mcore, overrides=()):
    from core.seeding import seed_everything

    cfg = load_config(cfg_path, list(overrides))
    seed_everything(0)
    model = get_model_builder(cfg.model.name)(cfg.model, cfg.parallel, torch.float32)
    return cfg, model


def _run(model, batch):
    return model(
        batch["tokens"], batch["position_ids"], labels=batch["labels"], pixel_values=batch["pixel_values"],
        image_grid_thw=batch["image_grid_thw"], packed_seq_params=packed_seq_params(batch),
    )


def _collate_kw(cfg):
    m = cfg.model
    return dict(pad_id=m.pad_token_id, image_token_id=m.image_token_id, merge=m.vision.spatial_merge_size)


def test_registry():
    assert "qwen35_vl" in MODEL_REGISTRY
    with pytest.raises(KeyError, match="qwen35_vl"):
        get_model_builder("llama")


def test_dense_proxy_has_every_layer_kind_and_trains_end_to_end(mcore):
    cfg, model = _build("configs/qwen35_vl_proxy.yaml", mcore)
    kinds = [type(layer.self_attention).__name__ for layer in model.language_model.decoder.layers]
    assert kinds == ["Qwen35GatedDeltaNet"] * 3 + ["MRopeSelfAttention"]
    ds = MockDataset(cfg.model, cfg.data, 256)
    batch = pack_thd([ds[0], ds[1]], 512, **_collate_kw(cfg))
    loss = _run(model, batch)
    assert loss.shape == (1, 512)
    (loss * batch["loss_mask"]).sum().backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    # every parameter, the vision tower's included, receives gradient through the answer tokens
    assert no_grad == []


def test_moe_proxy_forward_backward(mcore):
    cfg, model = _build("configs/qwen35_vl_proxy_moe.yaml", mcore, ["model.moe_token_dispatcher=allgather"])
    mlp = model.language_model.decoder.layers[0].mlp
    assert type(mlp).__name__ == "MoELayer" and mlp.shared_experts is not None
    ds = MockDataset(cfg.model, cfg.data, 256)
    batch = pack_thd([ds[2], ds[3]], 512, **_collate_kw(cfg))
    loss = _run(model, batch)
    (loss * batch["loss_mask"]).sum().backward()
    assert mlp.router.weight.grad is not None and mlp.router.weight.grad.abs().sum() > 0


def test_packed_samples_do_not_leak_into_each_other(mcore):
    """Per-token losses of a sample are the same alone, packed with others (THD), or padded (BSHD).

    This exercises the attention block mask, the GDN conv reset and the delta-rule state
    reset at sample boundaries, and MRoPE positions restarting per sample.
    """
    cfg, model = _build("configs/qwen35_vl_proxy.yaml", mcore)
    model.eval()
    ds = MockDataset(cfg.model, cfg.data, 256)
    a, b, c = ds[4], ds[5], ds[6]
    kw = _collate_kw(cfg)
    with torch.no_grad():
        packed = _run(model, pack_thd([a, b, c], 768, **kw))[0]
        la, lb = len(a["input_ids"]), len(b["input_ids"])
        alone_b = _run(model, pack_thd([b], 256, **kw))[0, :lb]
        padded = _run(model, pad_bshd([a, b], 256, **kw))
    torch.testing.assert_close(packed[la : la + lb], alone_b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[la : la + lb], padded[1, :lb], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:la], padded[0, :la], rtol=1e-5, atol=1e-5)


def test_packed_and_padded_batches_give_the_same_gradients(mcore):
    """THD packing vs BSHD padding of the same samples: same masked loss and the same gradient for
    every parameter (GDN, attention, MLP, vision)."""
    cfg, model = _build("configs/qwen35_vl_proxy.yaml", mcore)
    ds = MockDataset(cfg.model, cfg.data, 256)
    samples, kw = [ds[7], ds[8]], _collate_kw(cfg)
    grads, losses = [], []
    for batch in (pack_thd(samples, 512, **kw), pad_bshd(samples, 256, **kw)):
        model.zero_grad(set_to_none=True)
        loss = (_run(model, batch) * batch["loss_mask"]).sum()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    for name in grads[0]:
        # fp32 sums in a different order: ~4e-6 on gradients of magnitude ~10 was seen
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-5)


def test_image_feature_scatter_equals_masked_scatter_forward_and_backward():
    """The sync-free scatter (nonzero_static + index_copy) is exactly masked_scatter, both ways."""
    from models.base import scatter_image_features

    gen = torch.Generator().manual_seed(0)
    S, B, H = 9, 3, 5
    emb = torch.randn(S, B, H, generator=gen, requires_grad=True)
    tokens = torch.zeros(B, S, dtype=torch.long)
    tokens[0, 2:4] = tokens[1, 8] = tokens[2, 0] = 7  # image tokens at row edges too
    feats = torch.randn(4, H, generator=gen, requires_grad=True)
    ours = scatter_image_features(emb, tokens == 7, feats)
    ref = emb.transpose(0, 1).masked_scatter((tokens == 7).unsqueeze(-1), feats).transpose(0, 1)
    assert torch.equal(ours, ref)
    g = torch.randn(ours.shape, generator=gen)
    for a, b in zip(torch.autograd.grad(ours, [emb, feats], g), torch.autograd.grad(ref, [emb, feats], g)):
        assert torch.equal(a, b)
