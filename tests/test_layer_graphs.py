"""CUDA graphs for the decoder layers (models/performance/layer_graphs.py), on the CPU.

A CUDA graph cannot be captured here, so the graphs are replaced by ``EagerStandIn``, which
re-runs the captured function at each replay and copies into the same static tensors. All of
the rest is the real path: metadata padded into static buffers, the replay autograd node,
parameter gradients (fused into main_grad or not) through DDP's hooks, eager fallbacks.
tests/gpu/test_layer_graphs_gpu.py runs the same comparison with real graphs on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from helpers.proxy_fixtures import PROXY, accumulate, forward, packed_rows, proxy_model, wrap_ddp

from models.performance import layer_graphs, wgrad_fusion
from multimodal.config import ConfigError, load_config, validate


def test_static_batch_pads_segments_and_the_familys_chunk_table(monkeypatch):
    """The boundaries are padded by the shared StaticBatch; the GDN chunk table by the buffers
    Qwen3.5's ``graph_row_buffers`` hook makes for layers holding a GDN module."""
    from fused_kernels.gated_delta_rule import GDNVarlen
    from models.common.packed_seq import PackedRowParams
    from models.qwen35_vl import layer_hooks

    gdn = torch.nn.Linear(2, 2)  # stands in for a GDN layer: the hook finds its modules by class
    gdn.kernel_backend = "fla"
    monkeypatch.setattr(layer_hooks, "Qwen35GatedDeltaNet", torch.nn.Linear)
    cu = torch.tensor([0, 10, 300, 384], dtype=torch.int32)
    varlen = GDNVarlen.from_host(cu, "cpu")
    params = PackedRowParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=cu, mixer_varlen=varlen)
    rope = torch.arange(3 * 384).reshape(3, 1, 384)
    static = layer_graphs.StaticBatch(384, 8, rope, "cpu", layers=[torch.nn.Sequential(gdn)])
    [rows] = static.extras
    assert isinstance(rows, layer_hooks.GDNGraphRows) and static.params.mixer_varlen.chunk_indices is rows.chunks
    assert static.params.mixer_varlen.cu_seqlens is static.cu64
    assert static.refusal(params, rope) is None
    static.load(params, rope)
    assert static.cu32.tolist() == [0, 10, 300, 384] + [384] * 6  # empty segments up to 8, + 1 always empty
    assert torch.equal(static.cu64, static.cu32.long())
    # the chunk table counted from the lengths by hand: 10 -> 1 chunk of 64, 290 -> 5, 84 -> 2
    want = [[0, 0], *([1, j] for j in range(5)), [2, 0], [2, 1]]
    assert rows.chunks[:8].tolist() == want
    assert rows.chunks.shape[0] == 384 // 64 + 8
    assert (rows.chunks[8:] == torch.tensor([8, 0])).all()  # segment 8: [384, 384), masked out
    assert torch.equal(static.rope, rope)
    many = torch.arange(0, 385, 32, dtype=torch.int32)  # 12 samples > 8
    crowded = PackedRowParams(qkv_format="thd", cu_seqlens_q=many, cu_seqlens_q_padded=many,
                              mixer_varlen=GDNVarlen.from_host(many, "cpu"))
    assert "cuda_graphs.max_samples=8" in static.refusal(crowded, rope)
    bare = PackedRowParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=cu)
    assert "no GDN chunk table" in static.refusal(bare, rope)
    # layers without a GDN module: no family adds buffers, and a row without a chunk table fits
    plain = layer_graphs.StaticBatch(384, 8, rope, "cpu", layers=[torch.nn.Sequential(torch.nn.ReLU())])
    assert plain.extras == [] and plain.params.mixer_varlen is None and plain.refusal(bare, rope) is None


TINY = "tests/fixtures/tiny_dense_vl.yaml"  # no GDN layers: a family without graph_row_buffers


def _setup(overrides=(), config=PROXY):
    cfg, model = proxy_model(overrides, config=config)
    return model, wrap_ddp(model), packed_rows(cfg, [(0, 1), (2,), (3, 4, 5)])


@pytest.mark.parametrize("fused, to_main_grad, config", [
    (False, False, PROXY), (True, False, PROXY), (False, True, PROXY), (True, True, PROXY), (True, True, TINY)])
def test_graphed_layers_equal_eager_layers(mcore, fused, to_main_grad, config):
    model, ddp, batches = _setup(config=config)
    if fused:
        assert wgrad_fusion.enable(ddp) > 0
    eager_losses, eager_grads = accumulate(ddp, model, batches)
    graphs = layer_graphs.graph_decoder_layers(model.language_model, max_samples=4, graph_factory=layer_graphs.EagerStandIn,
                                  grads_to_main_grad=to_main_grad)
    for _ in range(2):  # the first pass captures, the second only replays
        losses, grads = accumulate(ddp, model, batches)
        for a, b in zip(losses, eager_losses):
            assert torch.equal(a, b)
        for name, g in eager_grads.items():
            assert g.abs().sum() > 0, name
            torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-9, msg=name)
    assert graphs.failed is None and graphs.graphed_batches == 6 and not graphs.eager_batches
    assert graphs.captures == 1  # reported per step in metrics.jsonl (cuda_graph_captures)
    if fused:  # the linear weights' gradients went into main_grad inside the backward "graph"
        assert all(g.fused for g in graphs.graphs)
        # and the graphs keep no static gradient for them (megatron's placeholder is dropped)
        assert all(g.static_grads[1 + j] is None for g in graphs.graphs for j in g.fused)
    for g in graphs.graphs:  # to_main_grad: every other parameter gradient too, none handed to autograd
        assert g.fused.isdisjoint(g.added)
        assert (g.fused | g.added == set(range(len(g.params)))) == to_main_grad
        assert bool(g.added) == to_main_grad


def _one_sample(batch):
    """The row as a single sample: its tail padding joins the sample (causal: the real tokens'
    outputs are unchanged), so ``max_seqlen`` is the row length."""
    from fused_kernels.gated_delta_rule import GDNVarlen

    n = batch["tokens"].shape[-1]
    cu = torch.tensor([0, n], dtype=torch.int32)
    return dict(batch, cu_seqlens=cu, cu_seqlens_padded=cu, max_seqlen=n,
                row_extras={"mixer_varlen": GDNVarlen.from_host(cu, "cpu")})


def test_one_sample_rows_get_their_own_graphs(mcore, monkeypatch):
    from models.common import core_attention as decoder_attention

    model, ddp, batches = _setup()
    batches = [batches[0], _one_sample(batches[1]), batches[2], _one_sample(batches[1])]
    told = []  # what each decoder attention call was told: one segment or not
    real = decoder_attention.attention
    monkeypatch.setattr(decoder_attention, "attention",
                        lambda *a, **kw: told.append(kw["one_segment"]) or real(*a, **kw))
    eager_losses, eager_grads = accumulate(ddp, model, batches)
    eager_told = list(told)
    assert True in eager_told and False in eager_told
    graphs = layer_graphs.graph_decoder_layers(model.language_model, max_samples=4, graph_factory=layer_graphs.EagerStandIn,
                                  one_segment_graphs=True)
    for _ in range(2):  # capture (two sets), then replay only
        told.clear()
        losses, grads = accumulate(ddp, model, batches)
        for a, b in zip(losses, eager_losses):
            assert torch.equal(a, b)
        for name, g in eager_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-9, msg=name)
    # the one-sample rows replay the set whose attention was told so, the packed rows the other
    assert told == eager_told
    assert set(graphs.sets) == {layer_graphs.PACKED, layer_graphs.ONE_SEGMENT} and graphs.captures == 2
    assert graphs.graphed_batches == 8 and not graphs.eager_batches
    assert graphs.sets[layer_graphs.PACKED].static.params.static_shape
    assert not graphs.sets[layer_graphs.ONE_SEGMENT].static.params.static_shape


def test_rows_that_do_not_fit_run_eagerly_and_are_counted(mcore):
    model, ddp, batches = _setup()
    eager_losses, eager_grads = accumulate(ddp, model, batches)
    # batches[2] holds 3 samples plus the tail padding: 4 segments, more than 3
    graphs = layer_graphs.graph_decoder_layers(model.language_model, max_samples=3, graph_factory=layer_graphs.EagerStandIn)
    losses, grads = accumulate(ddp, model, batches)
    assert graphs.graphed_batches == 2
    assert graphs.eager_batches == {"more than train.cuda_graphs.max_samples=3 samples in a row": 1}
    for a, b in zip(losses, eager_losses):
        assert torch.equal(a, b)
    for name, g in eager_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-9, msg=name)
    with torch.no_grad():  # evaluation: eager, counted under its own reason
        batch = batches[0]
        forward(model, batch)
    assert graphs.eager_batches["not training (no grad or eval mode)"] == 1
    graphs.close()  # the layers run their own forward again; the graphs are dropped
    assert all("forward" not in layer.__dict__ for layer in model.language_model.decoder.layers)
    assert graphs.graphs is None
    assert torch.equal(accumulate(ddp, model, batches)[0][0], eager_losses[0])


@pytest.mark.parametrize("override, message", [
    ("parallel.tp=2", "pp = tp = cp = 1"),
    ("train.recompute_modules=[core_attn]", "recompute"),
    ("data.pack=false", "data.pack=true"),
])
def test_config_refuses_what_graphs_cannot_replay(override, message):
    cfg = load_config("configs/qwen35_vl_proxy.yaml", ["train.cuda_graphs=true", override])
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validate(cfg, world_size=2)


def test_moe_models_graph_the_vision_encoder_only():
    """MoE decoder layers cannot be replayed (data-dependent routing), but that leaves the vision
    encoder's graphs allowed, with recompute of the eager decoder."""
    moe = load_config("configs/qwen35_vl_proxy_moe.yaml", ["train.cuda_graphs=true",
                                                           "train.recompute_modules=[moe_act]"])
    validate(moe)
    assert "MoE" in layer_graphs.decoder_layers_graphable(moe.model)
    dense = load_config("configs/qwen35_vl_proxy.yaml", ["train.cuda_graphs=true"])
    assert layer_graphs.decoder_layers_graphable(dense.model) is None


# ----------------------------------------------------------------------------- vision encoder


def _assert_rounding_close(grads, want):
    """Padded rows can change the CPU GEMMs' blocking (M = 44 and 64 take different kernels), so
    sums round differently: the gradients as a whole, and the vision encoder's own, agree to fp32
    rounding (a padding row attended to, or a gradient lost, is O(1)). Small gradients whose terms
    cancel (dt_bias) amplify the rounding, so they are not checked one by one."""
    flat = lambda d: torch.cat([t.flatten() for t in d.values()])  # noqa: E731
    assert float((flat(grads) - flat(want)).norm() / flat(want).norm()) < 1e-6
    for name, g in want.items():
        assert g.abs().sum() > 0, name
        if "vision_model" in name:
            rel = float((grads[name] - g).norm() / g.norm())
            assert rel < 1e-5, f"{name}: relative difference {rel:.2e}"


def test_vision_bucket_pads_segments_and_positions():
    from models.qwen35_vl.vision_geometry import VisionGeometry
    from models.qwen35_vl.vision_graphs import _Bucket

    cu = torch.tensor([0, 16, 44], dtype=torch.int32)
    geo = VisionGeometry(cu_seqlens=cu, max_seqlen=28, rot_pos=None, interp_index=None, interp_weight=None)
    pos = torch.arange(3 * 44).reshape(3, 44)
    inv = torch.ones(4)
    bucket = _Bucket(64, 4, (pos, inv, (0, 2, 2)), "cpu")  # 64 rows, 4 segment slots
    bucket.load((pos, inv, (0, 2, 2)), geo, 44)
    # two images, then the padding rows [44, 64) as a segment of their own, then empty segments
    assert bucket.cu.tolist() == [0, 16, 44, 64, 64, 64]
    assert bucket.geo.max_seqlen == 64 and bucket.geo.cu_seqlens is bucket.cu
    assert torch.equal(bucket.pos[:, :44], pos) and not bucket.pos[:, 44:].any()
    assert bucket.angles[0] is bucket.pos and bucket.angles[2] == (0, 2, 2)
    angles = torch.randn(44, 1, 8)  # the reference rotary's angles
    ref = _Bucket(64, 4, angles, "cpu")
    ref.load(angles, geo, 44)
    assert torch.equal(ref.angles[:44], angles) and not ref.angles[44:].any()


def test_vision_buckets_grow_geometrically():
    from models.qwen35_vl.vision_graphs import bucket_rows

    sizes = range(1, 200_000, 7)
    rows = [bucket_rows(p, 1024) for p in sizes]
    assert all(r >= p and r % 1024 == 0 for p, r in zip(sizes, rows))
    assert [bucket_rows(p, 1024) // 1024 for p in (1, 1024, 1025, 8192, 8193, 9300, 16385, 33000)] == \
        [1, 1, 2, 8, 9, 10, 18, 36]
    assert max((r - p) / p for p, r in zip(sizes, rows) if p > 8 * 1024) <= 1 / 8
    # the varied-document rows of the real-data benchmark (13-23K patches): 8 buckets, not 11
    assert len({bucket_rows(p, 1024) for p in range(13_000, 23_001)}) == 8


@pytest.mark.parametrize("with_decoder, to_main_grad, config", [
    (False, False, PROXY), (True, False, PROXY), (True, True, PROXY),
    (False, True, "configs/qwen35_vl_proxy_moe.yaml"),  # an MoE model: graphed vision, eager decoder
])
def test_graphed_vision_encoder_equals_eager(mcore, with_decoder, to_main_grad, config):
    cfg, model = proxy_model(config=config)
    ddp, batches = wrap_ddp(model), packed_rows(cfg, [(0, 1), (2,), (3, 4, 5)])
    # 44, 16 and 112 patches -> buckets of 64, 32 and 128 rows
    assert [b["pixel_values"].shape[0] for b in batches] == [44, 16, 112]
    eager_losses, eager_grads = accumulate(ddp, model, batches)
    if with_decoder:
        layer_graphs.graph_decoder_layers(model.language_model, max_samples=4, graph_factory=layer_graphs.EagerStandIn,
                             grads_to_main_grad=to_main_grad)
    graphs = model.vision_model.install_cuda_graphs(32, 8, 8, graph_factory=layer_graphs.EagerStandIn,
                                                    grads_to_main_grad=to_main_grad)
    for _ in range(2):  # the first pass captures each bucket, the second only replays
        losses, grads = accumulate(ddp, model, batches)
        for a, b in zip(losses, eager_losses):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        _assert_rounding_close(grads, eager_grads)
    assert graphs.failed is None and not graphs.eager_batches
    assert sorted(graphs.buckets) == [(32, 8), (64, 8), (128, 8)]  # (rows, segment slots)
    assert graphs.graphed_batches == 6 and graphs.captures == 3
    # to_main_grad: no shared gradient buffers; every gradient the graph computes is added to main_grad,
    # and the embeddings, which run outside the graph, are left to their own backward (a placeholder
    # for them would make DDP's hook drop their real gradient)
    names = [n for n, _ in model.vision_model.named_parameters()]
    buffered = {n for n, b in zip(names, graphs.grads) if b is not None}
    assert buffered == (set() if to_main_grad else set(names))
    for bucket in graphs.buckets.values():
        added = {names[j] for j in bucket.graph.added}
        outside = {n for n in names if n.startswith(("patch_embed.", "pos_embed."))}
        assert outside and added == (set(names) - outside if to_main_grad else set())


@pytest.mark.parametrize("tuning", ["freeze=[vision,merger]", "freeze=[vision]", "freeze=[language,embedding,lm_head]",
                                    "lora.rank=4"])
def test_fine_tuning_controls_replay_the_eager_gradients(mcore, tuning):
    """model.freeze and model.lora under the decoder and vision graphs: the trained weights get the
    eager gradients, the frozen ones none. A frozen vision encoder runs a forward-only graph; with
    the merger trained, the captured backward stops at the frozen blocks' output."""
    from multimodal.freeze import freeze
    from multimodal.lora import apply_lora

    cfg, model = proxy_model([f"model.{tuning}"])
    if cfg.model.lora.rank:
        apply_lora(model, cfg.model.lora, seed=0)
        for name, p in model.named_parameters():  # B starts at zero, which gives A no gradient
            if name.endswith("lora_B"):
                torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(1))
    freeze(model, cfg.model.freeze)
    ddp, batches = wrap_ddp(model), packed_rows(cfg, [(0, 1), (2,), (3, 4, 5)])
    wgrad_fusion.enable(ddp)  # the trained decoder linears (none when the language model is frozen)
    eager_losses, eager_grads = accumulate(ddp, model, batches)
    decoder = layer_graphs.graph_decoder_layers(model.language_model, max_samples=4, graph_factory=layer_graphs.EagerStandIn,
                                   grads_to_main_grad=True)
    vision = model.vision_model.install_cuda_graphs(32, 8, 8, graph_factory=layer_graphs.EagerStandIn,
                                                    grads_to_main_grad=True)
    for _ in range(2):
        losses, grads = accumulate(ddp, model, batches)
        for a, b in zip(losses, eager_losses):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert grads.keys() == eager_grads.keys()
        _assert_rounding_close(grads, eager_grads)
    assert decoder.failed is None and vision.failed is None
    assert decoder.graphed_batches == vision.graphed_batches == 6
    assert not decoder.eager_batches and not vision.eager_batches
    frozen_vision = not any(p.requires_grad for p in model.vision_model.parameters())  # LoRA: frozen too
    assert frozen_vision == (tuning not in ("freeze=[language,embedding,lm_head]", "freeze=[vision]"))
    for bucket in vision.buckets.values():
        assert (bucket.graph.bwd is None) == frozen_vision
        assert bucket.graph.static_in.requires_grad == (tuning == "freeze=[language,embedding,lm_head]")


def test_vision_buckets_captured_up_front_serve_every_later_batch(mcore):
    """train.cuda_graphs.vision_warmup_patches: the first micro-batch captures every bucket up to
    the limit on synthetic rows; the real batches then only replay, with the eager results."""
    from models.qwen35_vl.vision_graphs import bucket_sizes

    model, ddp, batches = _setup()
    eager_losses, eager_grads = accumulate(ddp, model, batches)
    graphs = model.vision_model.install_cuda_graphs(32, 8, 8, graph_factory=layer_graphs.EagerStandIn,
                                                    warmup_patches=120)
    losses, grads = accumulate(ddp, model, batches)
    assert sorted(rows for rows, _ in graphs.buckets) == bucket_sizes(120, 32) == [32, 64, 96, 128]
    assert graphs.graphed_batches == 3 and not graphs.eager_batches and graphs.capture_s > 0
    for a, b in zip(losses, eager_losses):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    _assert_rounding_close(grads, eager_grads)


def test_micro_batches_of_many_images_replay_buckets_with_more_segment_slots(mcore, monkeypatch):
    """A bucket is a row count and a number of segment slots: micro-batches of up to
    FEW_SEGMENTS images replay graphs with that many slots (the varlen grid is smaller), those of
    more replay graphs with max_images slots; both give the eager results."""
    from models.qwen35_vl import vision_graphs

    monkeypatch.setattr(vision_graphs, "FEW_SEGMENTS", 2)
    assert [vision_graphs.segment_slots(n, 8) for n in (1, 2, 3, 8)] == [2, 2, 8, 8]
    model, ddp, batches = _setup()
    eager_losses, eager_grads = accumulate(ddp, model, batches)
    graphs = model.vision_model.install_cuda_graphs(32, 8, 8, graph_factory=layer_graphs.EagerStandIn)
    losses, grads = accumulate(ddp, model, batches)
    # 4 images in 64 rows, 1 in 32, 6 in 128
    assert sorted(graphs.buckets) == [(32, 2), (64, 8), (128, 8)] and not graphs.eager_batches
    assert [b.cu.numel() for _, b in sorted(graphs.buckets.items())] == [4, 10, 10]
    for a, b in zip(losses, eager_losses):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    _assert_rounding_close(grads, eager_grads)


def test_config_checks_the_vision_warmup():
    cfg = load_config("configs/qwen35_vl_proxy.yaml", ["train.cuda_graphs=true",
                                                       "train.cuda_graphs.vision_warmup_patches=40000"])
    with pytest.raises(ConfigError, match="needs 26 vision buckets .* more than train.cuda_graphs.vision_max_buckets=24"):
        validate(cfg)


def test_vision_warmup_of_minus_one_covers_the_largest_row():
    """-1: every bucket up to micro_batch_size x seq_length x merge^2 patches (each merged patch
    is a token of the row); the proxy's 512-token rows hold at most 2048 patches: 2 buckets of 1024."""
    from multimodal.config import vision_warmup_patches

    cfg = load_config("configs/qwen35_vl_proxy.yaml", ["train.cuda_graphs=true",
                                                       "train.cuda_graphs.vision_warmup_patches=-1"])
    validate(cfg)
    assert vision_warmup_patches(cfg) == 1 * 512 * 2**2
    cfg = load_config("configs/qwen35_vl_2b.yaml", ["train.cuda_graphs.vision_warmup_patches=-1",
                                                    "train.seq_length=16384"])
    with pytest.raises(ConfigError, match=r"needs 32 vision buckets \(up to 65536 patches\)"):
        validate(cfg)
    cfg = load_config("configs/qwen35_vl_proxy.yaml", ["train.cuda_graphs=true", "train.cuda_graphs.vision_warmup_patches=-2"])
    with pytest.raises(ConfigError, match="must be >= 0, or -1"):
        validate(cfg)


def test_vision_micro_batches_that_do_not_fit_run_eagerly_and_are_counted(mcore):
    model, ddp, batches = _setup()
    eager_losses, eager_grads = accumulate(ddp, model, batches)
    # one bucket at most; at most 4 images: batch 0 (4 images, 64 rows) is captured, batch 1
    # (a 32-row bucket) is beyond the bucket limit, batch 2 (6 images) has too many images
    graphs = model.vision_model.install_cuda_graphs(32, 1, 4, graph_factory=layer_graphs.EagerStandIn)
    losses, grads = accumulate(ddp, model, batches)
    assert graphs.graphed_batches == 1 and list(graphs.buckets) == [(64, 4)]
    assert graphs.eager_batches == {
        "a 32-patch bucket beyond train.cuda_graphs.vision_max_buckets=1 (raise it or train.cuda_graphs.vision_bucket)": 1,
        "more than train.cuda_graphs.max_samples=4 attention segments (images, video frame pairs) in a micro-batch": 1}
    for a, b in zip(losses, eager_losses):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    _assert_rounding_close(grads, eager_grads)
    graphs.close()
    assert not {"blocks_and_merger", "embed_patches"} & set(model.vision_model.__dict__) and not graphs.buckets


def test_config_checks_the_vision_bucket():
    cfg = load_config("configs/qwen35_vl_proxy.yaml", ["train.cuda_graphs=true", "train.cuda_graphs.vision_bucket=30"])
    with pytest.raises(ConfigError, match="cuda_graphs.vision_bucket must be 0"):
        validate(cfg)
