"""CUDA graphs for the decoder layers (models/common/layer_graphs.py), on the CPU.

A CUDA graph cannot be captured here, so the graphs are replaced by ``EagerStandIn``, which
re-runs the captured function at each replay and copies into the same static tensors. All of
the rest is the real path: metadata padded into static buffers, the replay autograd node,
parameter gradients (fused into main_grad or not) through DDP's hooks, eager fallbacks.
scripts/check_layer_graphs_gpu.py runs the same comparison with real graphs on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from data.collate import pack_thd
from data.mock import MockDataset
from models import get_model_builder
from models.common import layer_graphs, wgrad_fusion
from multimodal.config import ConfigError, load_config, validate
from multimodal.forward_step import packed_seq_params, to_device


def test_static_batch_pads_segments_and_chunk_table():
    from kernels.gated_delta_rule import GDNVarlen
    from multimodal.context_parallel import PackedRowParams

    cu = torch.tensor([0, 10, 300, 384], dtype=torch.int32)
    varlen = GDNVarlen.from_host(cu, "cpu")
    params = PackedRowParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=cu, gdn_varlen=varlen)
    rope = torch.arange(3 * 384).reshape(3, 1, 384)
    static = layer_graphs.StaticBatch(384, 8, rope, "cpu")
    assert static.refusal(params, rope) is None
    static.load(params, rope)
    assert static.cu32.tolist() == [0, 10, 300, 384] + [384] * 6  # empty segments up to 8, + 1 always empty
    assert torch.equal(static.cu64, static.cu32.long())
    real = varlen.chunk_indices.shape[0]  # 1 + 5 + 2 chunks of 64
    assert real == 8
    assert torch.equal(static.chunks[:real], varlen.chunk_indices)
    assert static.chunks.shape[0] == 384 // 64 + 8
    assert (static.chunks[real:] == torch.tensor([8, 0])).all()  # segment 8: [384, 384), masked out
    assert torch.equal(static.rope, rope)
    many = torch.arange(0, 385, 32, dtype=torch.int32)  # 12 samples > 8
    crowded = PackedRowParams(qkv_format="thd", cu_seqlens_q=many, cu_seqlens_q_padded=many,
                              gdn_varlen=GDNVarlen.from_host(many, "cpu"))
    assert "cuda_graph_max_samples=8" in static.refusal(crowded, rope)


def _setup(overrides=()):
    from multimodal.platform import seed_everything

    cfg = load_config("configs/qwen35_vl_proxy.yaml", list(overrides))
    seed_everything(0)
    model = get_model_builder(cfg.model.name)(cfg.model, cfg.parallel, torch.float32)
    m = cfg.model
    ds = MockDataset(m, cfg.data, 256)
    pack = lambda idx: to_device(  # noqa: E731
        pack_thd([ds[i] for i in idx], 384, m.pad_token_id, m.image_token_id, m.vision.spatial_merge_size),
        torch.device("cpu"), torch.float32)
    batches = [pack([0, 1]), pack([2]), pack([3, 4, 5])]
    ddp = DistributedDataParallel(config=model.config, module=model,
                                  ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    return model, ddp, batches


def _accumulate(ddp, model, batches):
    """Losses of each micro-batch, then main_grad after all of them (gradient accumulation)."""
    ddp.zero_grad_buffer()
    losses = []
    for batch in batches:
        loss = model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                     pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                     packed_seq_params=packed_seq_params(batch))
        (loss * batch["loss_mask"]).sum().backward()
        losses.append(loss.detach())
    return losses, {n: p.main_grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("fused", [False, True])
def test_graphed_layers_equal_eager_layers(mcore, fused):
    model, ddp, batches = _setup()
    if fused:
        assert wgrad_fusion.enable(ddp) > 0
    eager_losses, eager_grads = _accumulate(ddp, model, batches)
    graphs = layer_graphs.install(model.language_model, max_samples=4, graph_factory=layer_graphs.EagerStandIn)
    for _ in range(2):  # the first pass captures, the second only replays
        losses, grads = _accumulate(ddp, model, batches)
        for a, b in zip(losses, eager_losses):
            assert torch.equal(a, b)
        for name, g in eager_grads.items():
            assert g.abs().sum() > 0, name
            torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-9, msg=name)
    assert graphs.failed is None and graphs.graphed_batches == 6 and not graphs.eager_batches
    if fused:  # the linear weights' gradients went into main_grad inside the backward "graph"
        assert all(g.fused for g in graphs.graphs)


def test_rows_that_do_not_fit_run_eagerly_and_are_counted(mcore):
    model, ddp, batches = _setup()
    eager_losses, eager_grads = _accumulate(ddp, model, batches)
    # batches[2] holds 3 samples plus the tail padding: 4 segments, more than 3
    graphs = layer_graphs.install(model.language_model, max_samples=3, graph_factory=layer_graphs.EagerStandIn)
    losses, grads = _accumulate(ddp, model, batches)
    assert graphs.graphed_batches == 2
    assert graphs.eager_batches == {"more than train.cuda_graph_max_samples=3 samples in a row": 1}
    for a, b in zip(losses, eager_losses):
        assert torch.equal(a, b)
    for name, g in eager_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-9, msg=name)
    with torch.no_grad():  # evaluation: eager, counted under its own reason
        batch = batches[0]
        model(batch["tokens"], batch["position_ids"], labels=batch["labels"], pixel_values=batch["pixel_values"],
              image_grid_thw=batch["image_grid_thw"], packed_seq_params=packed_seq_params(batch))
    assert graphs.eager_batches["not training (no grad or eval mode)"] == 1
    graphs.close()  # the layers run their own forward again; the graphs are dropped
    assert all("forward" not in layer.__dict__ for layer in model.language_model.decoder.layers)
    assert graphs.graphs is None
    assert torch.equal(_accumulate(ddp, model, batches)[0][0], eager_losses[0])


@pytest.mark.parametrize("override, message", [
    ("parallel.tp=2", "pp = tp = cp = 1"),
    ("train.recompute_modules=[core_attn]", "recompute"),
    ("data.pack=false", "data.pack=true"),
])
def test_config_refuses_what_graphs_cannot_replay(override, message):
    cfg = load_config("configs/qwen35_vl_proxy.yaml", ["train.cuda_graphs=true", override])
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validate(cfg, world_size=2)
    moe = load_config("configs/qwen35_vl_proxy_moe.yaml", ["train.cuda_graphs=true"])
    with pytest.raises(ConfigError, match="MoE"):
        validate(moe)
