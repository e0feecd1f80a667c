"""train.fp8 on the CPU (the emulated path: quantize, dequantize, fp32 matmul): the FP8 linear and
grouped GEMMs against a plain quantize-dequantize reference written here, a hand-computed tiny
case, gradients through the whole proxy model, exclusions, LoRA, and a bit-exact resume.
The CUDA fast path (torch._scaled_mm / _scaled_grouped_mm) is checked against the emulation by
the gpu-marked test at the end."""

from __future__ import annotations

import types

import pytest
import torch

from helpers.proxy_fixtures import forward, optimizer_steps, packed_rows
from models.common import fp8, fp8_gemm
from multimodal.config import ConfigError, load_config, validate

PROXY = "configs/qwen35_vl_proxy.yaml"
MOE = "configs/qwen35_vl_proxy_moe.yaml"
F8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


# ----------------------------------------------------------------------------- the reference


def qdq(t: torch.Tensor, dim, dtype, pow2: bool) -> torch.Tensor:
    """Quantize-dequantize written out: scale = fp8 max / amax (over ``dim``, or all), rounded
    down to a power of two if asked, saturating cast, divide back; fp32."""
    t = t.double()
    a = t.abs().max() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = torch.finfo(dtype).max / a.clamp(min=1e-12)
    if pow2:
        scale = 2.0 ** torch.floor(torch.log2(scale))
    scale = scale.float()
    limit = torch.finfo(dtype).max
    return ((t.float() * scale).clamp(-limit, limit).to(dtype).float() / scale)


def reference_linear(x, w, g, recipe: str):
    """(out, dx, dw) of y = x w^T with the recipe's casts: forward x, w in e4m3; backward the
    output gradient in e5m2 (tensorwise) or e4m3 (rowwise), rowwise scales along each GEMM's
    contraction dimension."""
    if recipe == "tensorwise":
        xq, wq, gq = qdq(x, None, F8["e4m3"], False), qdq(w, None, F8["e4m3"], False), qdq(g, None, F8["e5m2"], False)
        return xq @ wq.t(), gq @ wq, gq.t() @ xq
    e4 = F8["e4m3"]
    out = qdq(x, 1, e4, True) @ qdq(w, 1, e4, True).t()
    dx = qdq(g, 1, e4, True) @ qdq(w, 0, e4, True)
    dw = qdq(g, 0, e4, True).t() @ qdq(x, 0, e4, True)
    return out, dx, dw


def _linear(x, w, recipe: str, hp_rows: int = 0, accumulate: bool = False):
    spec = fp8._Spec(fp8_gemm.RECIPES[recipe], "out", None, hp_rows)
    return fp8._Fp8Linear.apply(x, w, None, spec, accumulate, False, False, None)


# ----------------------------------------------------------------------------- numerics


def test_hand_computed_quantization():
    """x = [[1, -3], [0.5, 2]] and [[1.1, -3], [0.5, 2]] by hand. Tensorwise: scale 448/3; 149.3
    -> 144 (e4m3 steps of 16 in [128, 256)), 74.7 -> 72 (steps of 8), 298.7 -> 288 (steps of 32),
    -448 exact. Rowwise (power-of-two scales): 448/3 and 448/2 both round down to 128;
    1.1 * 128 = 140.8 -> 144, i.e. 1.125; the rest are exact."""
    x = torch.tensor([[1.0, -3.0], [0.5, 2.0]])
    got = fp8_gemm.quantize(x, None, fp8_gemm.E4M3, False).dequantize()
    want = torch.tensor([[144.0, -448.0], [72.0, 288.0]]) * 3 / 448
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    x = torch.tensor([[1.1, -3.0], [0.5, 2.0]])
    q = fp8_gemm.quantize(x, -1, fp8_gemm.E4M3, True)
    assert q.inv_scale.flatten().tolist() == [1 / 128, 1 / 128]
    assert q.dequantize().tolist() == [[1.125, -3.0], [0.5, 2.0]]
    # e5m2 (2 mantissa bits), the tensorwise gradient type: the amax maps onto its max, 57344
    g = fp8_gemm.quantize(torch.tensor([[0.3, -0.1]]), None, fp8_gemm.E5M2, False)
    assert g.data.float().tolist() == [[57344.0, -20480.0]]  # 19114.7 -> 20480 (steps of 4096 in [16384, 32768))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emulated_linear_equals_the_reference(recipe, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(48, 32, generator=gen) * 3).to(dtype).requires_grad_()
    w = (torch.randn(64, 32, generator=gen) * 0.05).to(dtype).requires_grad_()
    g = torch.randn(48, 64, generator=gen).to(dtype)
    out = _linear(x, w, recipe)
    out.backward(g)
    want_out, want_dx, want_dw = reference_linear(x.detach(), w.detach(), g, recipe)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), want_out, **tol)
    torch.testing.assert_close(x.grad.float(), want_dx, **tol)
    torch.testing.assert_close(w.grad.float(), want_dw, **tol)
    # and FP8 is really in the way: the plain product differs by far more than rounding
    assert (out.float() - x.detach().float() @ w.detach().float().t()).abs().max() > 1e-3


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_high_precision_tail_rows_and_main_grad_accumulation(recipe):
    """The last hp_rows output rows (GDN's beta / alpha) are plain fp32 products; the weight
    gradient added into main_grad (accumulation fusion) equals the returned one."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 16, generator=gen).requires_grad_()
    w = (torch.randn(16 + 4, 16, generator=gen) * 0.1).requires_grad_()
    g = torch.randn(32, 20, generator=gen)
    out = _linear(x, w, recipe, hp_rows=4)
    out.backward(g)
    ref_out, ref_dx, ref_dw = reference_linear(x.detach(), w.detach()[:16], g[:, :16], recipe)
    torch.testing.assert_close(out[:, :16], ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, 16:], x.detach() @ w.detach()[16:].t(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_dx + g[:, 16:] @ w.detach()[16:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad[16:], g[:, 16:].t() @ x.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad[:16], ref_dw, rtol=1e-5, atol=1e-5)

    w2 = w.detach().clone().requires_grad_()
    w2.main_grad = torch.ones_like(w2)
    w2.grad_added_to_main_grad = False
    _linear(x.detach(), w2, recipe, hp_rows=4, accumulate=True).backward(g)
    assert w2.grad_added_to_main_grad
    torch.testing.assert_close(w2.main_grad, w.grad + 1, rtol=1e-6, atol=1e-6)


def _grouped_reference(a, b, offs):
    """Per-group products of per-group quantize-dequantized operands (rowwise, e4m3, pow2)."""
    e4, ends = F8["e4m3"], offs.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:
        aq, bq = qdq(a, 1, e4, True), qdq(b, 1, e4, True)
        return torch.cat([aq[s:e] @ bq[i] for i, (s, e) in enumerate(zip(starts, ends))])
    return torch.stack([qdq(a[:, s:e], 1, e4, True) @ qdq(b[s:e], 0, e4, True) if e > s
                        else a.new_zeros(a.shape[0], b.shape[1]) for s, e in zip(starts, ends)])


def test_emulated_grouped_gemm_equals_the_reference():
    gen = torch.Generator().manual_seed(2)
    offs = torch.tensor([5, 5, 17, 24], dtype=torch.int32)  # group 1 empty
    a = torch.randn(24, 32, generator=gen) * 2
    b = torch.randn(4, 32, 48, generator=gen) * 0.1
    torch.testing.assert_close(fp8.grouped_mm(a, b, offs), _grouped_reference(a, b, offs), rtol=1e-5, atol=1e-5)
    g = torch.randn(24, 48, generator=gen)
    got = fp8.grouped_mm(g.t(), a, offs)  # the weight-gradient form: [48, N] x [N, 32] -> [4, 48, 32]
    want = _grouped_reference(g.t(), a, offs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not got[1].any()  # the empty group


# ----------------------------------------------------------------------------- the model


def _build(mcore, config, overrides=(), seed=0):
    from core.seeding import seed_everything
    from multimodal.training import build_model_and_optimizer

    cfg = load_config(config, [*overrides, "optimizer.lr=1e-2", "optimizer.warmup_iters=0"])
    validate(cfg)
    seed_everything(seed)
    return cfg, *build_model_and_optimizer(cfg, mcore, torch.float32)


def test_moe_proxy_converts_the_decoder_and_trains_every_parameter(mcore):
    """Every decoder linear, shared expert and routed-expert group in FP8; the vision tower,
    routers and LM head excluded; GDN's beta/alpha rows in high precision; a gradient reaches
    every trained parameter; the loss moves away from bf16's by FP8 rounding, not more."""
    cfg, model, ddp, optimizer, scheduler = _build(mcore, MOE)
    batch = packed_rows(cfg)[0]
    with torch.no_grad():
        bf16_loss = (forward(model, batch) * batch["loss_mask"]).sum()
    report = fp8.convert(model, "rowwise", cfg.train.fp8_exclude)
    names = dict(model.named_modules())
    assert report.fp8 and not report.unaligned
    layers = cfg.model.num_layers
    # per layer: the mixer's two projections, the shared expert's fc1 / fc2 and the routed experts
    assert len(report.fp8) == 5 * layers, report.fp8
    assert sum(n.endswith(".experts") for n in report.fp8) == layers
    assert all(not n.startswith("vision_model") and "router" not in n and "output_layer" not in n for n in report.fp8)
    assert any(n.startswith("vision_model") for n in report.excluded) or not any(
        n.startswith("vision_model") and hasattr(m, "_forward_impl") for n, m in names.items())
    in_proj = [names[n] for n in report.fp8 if n.endswith("in_proj")]
    assert in_proj and all(m._forward_impl.args[1].hp_rows == 2 * cfg.model.linear_num_value_heads for m in in_proj)
    line = report.line()
    assert f"{len(report.fp8)} modules in FP8" in line and "*.router" in line
    assert f"{len(in_proj)} with their *_ba rows (GDN beta / alpha) in bf16" in line

    loss = optimizer_steps(cfg, model, ddp, optimizer, scheduler, 1)[0]
    assert loss != bf16_loss
    assert abs(loss - bf16_loss) / bf16_loss < 0.02, (loss, bf16_loss)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    missing = [n for n, p in trained.items() if not p.main_grad.any()]
    assert not missing, missing


def test_exclusion_patterns_are_respected(mcore):
    cfg, model, *_ = _build(mcore, PROXY)
    report = fp8.convert(model, "tensorwise", ["vision_model.*", "*output_layer", "*.mlp.*"])
    assert report.fp8 and all(".mlp." not in n for n in report.fp8)
    assert sum(".mlp." in n for n in report.excluded) == 2 * cfg.model.num_layers
    # in_proj_ba is not excluded here: the whole in_proj (392 rows, not a multiple of 16) stays bf16
    assert all(n.endswith("in_proj") for n in report.unaligned) and report.unaligned
    for name, module in model.named_modules():
        assert hasattr(module, "fp8_recipe") == (name in report.fp8 and not name.endswith("experts"))


def test_lora_base_in_fp8_adapters_train(mcore):
    lora = ["model.lora.rank=4", "model.lora.alpha=8"]
    cfg, model, ddp, optimizer, scheduler = _build(mcore, PROXY, [*lora, "train.fp8=tensorwise"])
    converted = [n for n, m in model.named_modules() if getattr(m, "fp8_recipe", None) == "tensorwise"]
    assert any(n.endswith("linear_qkv") for n in converted) and any(n.endswith("in_proj") for n in converted)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = optimizer_steps(cfg, model, ddp, optimizer, scheduler, 1)
    assert all(torch.isfinite(x) for x in losses)
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all(".lora_" in n for n in changed)
    assert any(n.endswith("lora_B") for n in changed)


def test_fp8_run_resumes_bit_exact(mcore, tmp_path):
    """FP8 keeps no state of its own (scales come from the current tensors): a run resumed from a
    checkpoint (built from another seed) repeats the uninterrupted run's losses bit for bit."""
    from multimodal import checkpointing

    def run(seed):  # the trainer's model transforms convert it (multimodal/transforms.py Fp8)
        cfg, *rest = _build(mcore, PROXY, ["train.fp8=rowwise"], seed=seed)
        assert any(getattr(m, "fp8_recipe", None) == "rowwise" for m in rest[0].modules())
        return cfg, rest

    cfg, rest = run(0)
    optimizer_steps(cfg, *rest, steps=1)
    model, ddp, optimizer, scheduler = rest
    checkpointing.save(str(tmp_path), 1, model, optimizer, scheduler, {})
    uninterrupted = optimizer_steps(cfg, *rest, steps=1)
    cfg, rest = run(1)
    model, ddp, optimizer, scheduler = rest
    assert checkpointing.load(checkpointing.resolve("latest", str(tmp_path)), model, optimizer, scheduler)[0] == 1
    resumed = optimizer_steps(cfg, *rest, steps=1)
    assert torch.equal(resumed[0], uninterrupted[0])


def test_the_trainer_plans_fp8_before_the_graphs():
    from multimodal.transforms import TRANSFORMS, Fp8, check_order, plan

    rt = types.SimpleNamespace(is_cuda=False, device=torch.device("cpu"))
    names = [t.name for t in plan(load_config(PROXY, ["train.fp8=tensorwise"]), rt)]
    assert "fp8" in names and "fp8" not in [t.name for t in plan(load_config(PROXY, []), rt)]
    moved = [t for t in TRANSFORMS if not isinstance(t, Fp8)] + [Fp8()]
    with pytest.raises(RuntimeError, match="'fp8' must come before 'decoder_graphs'"):
        check_order(moved)


def test_config_refuses_an_unknown_recipe():
    with pytest.raises(ConfigError, match=r"train\.fp8 must be null \(bf16\), tensorwise or rowwise"):
        validate(load_config(PROXY, ["train.fp8=e4m3"]))


@pytest.mark.parametrize("tokens", [1000, 1024, 8])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fast_path_operands_pass_torchs_own_checks(recipe, tokens, monkeypatch):
    """The fast path's calls, on meta tensors: torch's meta kernels of _scaled_mm /
    _scaled_grouped_mm carry the CUDA kernels' checks (16-byte strides, K % 16, layouts, scale
    shapes). A token count that is no multiple of 16 is the contraction of every weight gradient
    (dense and grouped); it is padded with zeros, which the second test shows change no product."""
    monkeypatch.setattr(fp8_gemm, "fast_path_reason", lambda *a, **k: None)
    x = torch.randn(tokens, 256, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(512, 256, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out = _linear(x, w, recipe)
    out.backward(torch.randn(tokens, 512, device="meta", dtype=torch.bfloat16))
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    offs = torch.tensor([tokens // 10, tokens // 10, tokens // 2, tokens], dtype=torch.int32, device="meta")
    b = torch.randn(4, 256, 128, device="meta", dtype=torch.bfloat16)
    assert fp8.grouped_mm(x.detach(), b, offs).shape == (tokens, 128)
    assert fp8.grouped_mm(out.detach().t(), x.detach(), offs).shape == (4, 512, 256)


def test_contraction_padding_changes_no_product():
    a = torch.randn(24, 1000).to(fp8_gemm.E4M3)
    b = torch.randn(40, 1000).to(fp8_gemm.E4M3).t()  # [K, N], column-major as the GEMM takes it
    a_pad, b_pad = fp8_gemm._contraction_padded(a, b)
    assert a_pad.shape == (24, 1008) and b_pad.shape == (1008, 40) and b_pad.stride() == (1, 1008)
    assert torch.equal(a_pad.float() @ b_pad.float(), a.float() @ b.float())
    assert not a_pad[:, 1000:].float().any() and not b_pad[1000:].float().any()


def test_group_padding_aligns_every_group_and_changes_no_product():
    """The grouped weight gradient's contraction (the routed tokens, grouped by expert) padded per
    group: every group starts on a multiple of 16 (torch's grouped FP8 GEMM asserts it on the
    device), tokens past the last offset stay out of every group, and each group's product is
    unchanged (small integers: exact in fp32)."""
    gen = torch.Generator().manual_seed(0)
    offs = torch.tensor([100, 100, 517, 990], dtype=torch.int32)  # an empty group; 10 tokens in none
    a = torch.randint(-3, 4, (24, 1000), generator=gen).float()
    b = torch.randint(-3, 4, (1000, 40), generator=gen).float()
    a_pad, b_pad, new_offs = fp8_gemm._groups_padded(a, b, offs)
    assert new_offs.tolist() == [112, 112, 544, 1024] and new_offs.dtype == offs.dtype
    assert a_pad.shape == (24, 1008 + 64) and b_pad.shape == (1072, 40) and b_pad.stride() == (1, 1072)
    torch.testing.assert_close(fp8_gemm.grouped_mm_reference(a_pad, b_pad, new_offs),
                               fp8_gemm.grouped_mm_reference(a, b, offs), rtol=0, atol=0)
    assert a_pad[:, new_offs[-1]:].abs().sum() == a[:, 990:].abs().sum()  # the ungrouped tail, kept apart
    e4m3 = fp8_gemm._groups_padded(a.to(fp8_gemm.E4M3), b.to(fp8_gemm.E4M3), offs)  # one-byte elements
    assert torch.equal(e4m3[0].float(), a_pad) and torch.equal(e4m3[1].float(), b_pad)


def test_compiled_casts_cover_every_operand_kind_of_both_recipes(monkeypatch):
    """On the GPU the amax and the cast run compiled (dynamo + inductor), as one function where no
    all-reduce sits between them; dynamo compiles each once per operand kind (rank, layout, scale
    shape, fp8 type, amax dimension, layout written): here 1 amax, 4 casts, 7 quantizations. Both recipes' linear
    forward and backward and the grouped GEMMs, driven through the same wrapper with dynamo's
    eager backend (its guards and recompiles, no code generation), stay within the recompile
    limit and give the eager numbers. Before the wrapper detached its input, requires_grad was
    one more guard: this sequence then needed 10 compilations of the cast, over dynamo's default
    of 8 (the GPU test failed so, on the rowwise recipe after the tensorwise one)."""
    import torch._dynamo

    torch._dynamo.reset()
    monkeypatch.setattr(fp8_gemm, "_kernel", lambda fn, x: fp8_gemm._compiled(fn, "eager"))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 32, generator=gen, requires_grad=True)
    w = (torch.randn(48, 32, generator=gen) * 0.05).requires_grad_()
    g = torch.randn(40, 48, generator=gen)
    offs = torch.tensor([8, 8, 24, 40], dtype=torch.int32)
    b = torch.randn(4, 32, 16, generator=gen) * 0.05

    def run():
        outs = []
        for recipe in ("tensorwise", "rowwise"):
            xi, wi = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
            out = _linear(xi, wi, recipe)
            out.backward(g)
            outs += [out, xi.grad, wi.grad]
        return outs + [fp8.grouped_mm(x.detach(), b, offs), fp8.grouped_mm(g.t(), x.detach(), offs)]

    compiled = run()
    kinds = [len(torch._dynamo.eval_frame._debug_get_cache_entry_list(f.__code__))
             for f in (fp8_gemm._amax, fp8_gemm._scaled_cast, fp8_gemm._quantize)]
    monkeypatch.setattr(fp8_gemm, "_kernel", lambda fn, x: fn)
    for c, e in zip(compiled, run()):
        torch.testing.assert_close(c, e, rtol=0, atol=0)
    assert min(kinds) >= 1 and max(kinds) <= fp8_gemm.RECOMPILE_LIMIT  # compiled, and within the limit
    torch._dynamo.reset()


def test_inductor_compiles_the_quantizations_to_the_eager_bits_and_layouts():
    """The quantizations as inductor compiles them (its CPU code generation here; the graph and its
    lowering are the GPU's): the same fp8 bytes and inverse scales as eager, and the column-major
    cast written column-major, so the GEMM takes it without a copy."""
    import torch._dynamo

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 64, generator=gen).bfloat16()
    w = torch.randn(4, 64, 32, generator=gen).bfloat16()
    cases = [(x, -1, fp8_gemm.E4M3, True, False), (x, None, fp8_gemm.E5M2, False, False),
             (w, -2, fp8_gemm.E4M3, True, True), (x, 0, fp8_gemm.E4M3, False, True)]
    compiled = torch.compile(fp8_gemm._quantize, dynamic=True, fullgraph=True)
    for args in cases:
        (data, inv), (want, want_inv) = compiled(*args), fp8_gemm._quantize(*args)
        assert torch.equal(data.view(torch.uint8), want.view(torch.uint8)) and torch.equal(inv, want_inv)
        assert data.stride() == want.stride()
        if args[-1]:  # column_major
            assert data.stride(-2) == 1
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_scaled_mm_matches_the_emulation(recipe, monkeypatch):
    """torch._scaled_mm / _scaled_grouped_mm against the emulated path on the same casts (bf16)."""
    if fp8_gemm.fast_path_reason(torch.device("cuda")) is not None:
        pytest.skip(fp8_gemm.fast_path_reason(torch.device("cuda")))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1000, 256, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(512, 256, device="cuda", generator=gen) * 0.05).bfloat16().requires_grad_()
    g = torch.randn(1000, 512, device="cuda", generator=gen).bfloat16()
    offs = torch.tensor([100, 100, 517, 1000], dtype=torch.int32, device="cuda")
    b = (torch.randn(4, 256, 128, device="cuda", generator=gen) * 0.05).bfloat16()

    def run():
        xi, wi = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        out = _linear(xi, wi, recipe)
        out.backward(g)
        return out, xi.grad, wi.grad, fp8.grouped_mm(x.detach(), b, offs), fp8.grouped_mm(g.t(), x.detach(), offs)

    fast = run()
    monkeypatch.setattr(fp8_gemm, "fast_path_reason", lambda *a, **k: "forced emulation")
    emulated = run()
    for f, e in zip(fast, emulated):
        err = ((f.float() - e.float()).norm() / e.float().norm()).item()
        assert err < 1e-2, err


def test_bench_ab_reports_fp8_speedup():
    """bench_train --ab train.fp8=...: FP8 tokens/s over the mean of the two bf16 (A) runs; the
    reverse A/B (A in FP8, B bf16) inverts; an A/B that does not switch FP8 gets none."""
    from scripts.bench_train import add_fp8_speedup

    def ab(spec, b, a_again):
        return {spec: {"b": {"tokens_per_s": b}, "a_again": {"tokens_per_s": a_again}}}

    rows = ab("train.fp8=tensorwise", 150.0, 110.0)
    add_fp8_speedup(rows, ["train.iters=5"], 90.0)
    assert rows["train.fp8=tensorwise"]["fp8_speedup"] == 1.5 and rows["train.fp8=tensorwise"]["fp8_recipe"] == "tensorwise"
    rows = ab("train.fp8=null", 100.0, 130.0)
    add_fp8_speedup(rows, ["train.fp8=rowwise"], 110.0)
    assert rows["train.fp8=null"]["fp8_speedup"] == 1.2
    rows = ab("train.cuda_graphs=true", 100.0, 100.0)
    add_fp8_speedup(rows, ["train.fp8=rowwise"], 100.0)
    assert "fp8_speedup" not in rows["train.cuda_graphs=true"]


def test_dry_run_and_oom_advice_count_the_casts():
    """9B recipe at tp=1, one 8K row: the dry run adds the fp8 casts of the widest GEMM (the MLP's
    fc1: 2 x 12288 columns; 8192 x 24576 activation + gradient and 24576 x 4096 weight twice, one
    byte each) to the activations and says so; the OOM advice names the figure and the fix."""
    from multimodal.dry_run import dry_run
    from multimodal.observability.oom_advice import advice

    def activ(overrides):
        lines = []
        cfg = load_config("configs/qwen35_vl_9b.yaml", ["parallel.tp=1", *overrides])
        dry_run(cfg, world_size=1, gpu_mem_gib=1000, out=lines.append)
        row = next(line for line in lines if line.strip().startswith("0 "))
        return float(row.split()[7]), lines

    base, _ = activ([])
    with_fp8, lines = activ(["train.fp8=tensorwise"])
    want = (2 * 8192 * 24576 + 2 * 4096 * 24576) / 2**30
    assert with_fp8 - base == pytest.approx(want, abs=0.06)
    assert any("train.fp8=tensorwise" in line for line in lines)
    text = advice(load_config("configs/qwen35_vl_9b.yaml", ["parallel.tp=1", "train.fp8=rowwise"]), 5)
    assert f"train.fp8=rowwise adds about {want:.2f} GiB" in text and "train.fp8=null" in text
    assert "train.fp8" not in advice(load_config("configs/qwen35_vl_9b.yaml", []), 5)


def test_compare_loss_verdict(tmp_path):
    """scripts/compare_loss.py: the last-N mean within tolerance and no spike of B's own pass; a
    spike B has alone, or a tail 2% higher, fails; a spike both runs share does not."""
    import json as _json

    from scripts.compare_loss import main

    def write(name, curve):
        path = tmp_path / name
        path.write_text("".join(_json.dumps({"step": s, "loss": v}) + "\n" for s, v in curve.items()))
        return str(path)

    base = {s: 5.0 - s / 100 for s in range(1, 151)}
    both = {**base, 60: 6.0}
    a = write("a.jsonl", both)
    assert main([a, write("same.jsonl", {s: v * 1.005 for s, v in both.items()}), "--last", "50"]) == 0
    assert main([a, write("spike.jsonl", {**both, 100: 6.0}), "--last", "50"]) == 1
    assert main([a, write("high.jsonl", {s: v * 1.02 for s, v in both.items()}), "--last", "50",
                 "--json", str(tmp_path / "r.json")]) == 1
    assert _json.loads((tmp_path / "r.json").read_text())["rel_diff"] == pytest.approx(0.02)


def _expert_tp_worker(rank: int, world: int, init_file: str, with_group: bool, out: dict):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(0)
        # rank 0's features are large and meet zeros in b; rank 1's are 1e-5 of them: in fp8 with
        # the whole rows' scales they fall among the subnormals (the one-process quantization),
        # with a scale of their own they would not
        a = torch.randn(40, 64, generator=gen)
        a[:, 32:] *= 1e-5
        b = torch.randn(3, 64, 32, generator=gen)
        b[:, :32] = 0
        offs = torch.tensor([10, 25, 40], dtype=torch.int32)
        k = a.shape[1] // world
        cols = slice(rank * k, (rank + 1) * k)
        part = fp8.grouped_mm(a[:, cols].contiguous(), b[:, cols].contiguous(), offs,
                              dist.group.WORLD if with_group else None)
        dist.all_reduce(part)  # what the expert TP reduction of fc2's output does
        if rank == 0:
            out["split"] = part
            out["whole"] = fp8.grouped_mm(a, b, offs)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("with_group", [True, False], ids=["amax_all_reduced", "local_amax"])
def test_expert_tp_split_contraction_quantizes_as_one_process(tmp_path, with_group):
    """Under expert tensor parallelism fc2's input features (and fc1's input gradient's contraction)
    are split over the ranks. With the amax all-reduced over the expert TP group, each rank casts
    its shard with the scales of the whole rows, so the reduced product equals one process's up to
    fp32 summation order; with each rank's local amax (the control) it does not. (The experts'
    power-of-two scales make a shard's local scale matter only where values cross the fp8
    subnormal range, which the data here is built to do.)"""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_expert_tp_worker, args=(2, str(tmp_path / "init"), with_group, out), nprocs=2)
        split, whole = out["split"], out["whole"]
    err = ((split - whole).abs().max() / whole.abs().max()).item()
    if with_group:
        assert err < 1e-5, err
    else:
        assert err > 1e-3, err  # the control: local scales change the quantized values


def test_expert_mlp_sends_the_ffn_contractions_to_the_split_gemm():
    """_ExpertMLP's two products that contract over the expert FFN (which expert TP splits) go to
    ``split_gemm``, the other four to ``gemm``; GroupedExperts passes the FP8 GEMM with the expert
    TP group as ``split_gemm`` when that group has more than one rank."""
    from fused_kernels.grouped_gemm import grouped_mm
    from models.common.grouped_experts import _ExpertMLP

    calls = []

    def spy(name):
        def gemm(a, b, offs):
            calls.append((name, tuple(a.shape), tuple(b.shape)))
            return grouped_mm(a, b, offs)
        return gemm

    n, h, f, e = 12, 16, 8, 2
    x = torch.randn(n, h, requires_grad=True)
    w1 = torch.randn(e, 2 * f, h, requires_grad=True)
    w2 = torch.randn(e, h, f, requires_grad=True)
    probs, offs = torch.rand(n), torch.tensor([5, 12], dtype=torch.int32)
    _ExpertMLP.apply(x, w1, w2, probs, offs, False, spy("gemm"), spy("split")).sum().backward()
    split = [c for c in calls if c[0] == "split"]
    assert len(calls) == 6 and split == [("split", (n, f), (e, f, h)), ("split", (n, 2 * f), (e, 2 * f, h))]
