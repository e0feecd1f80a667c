"""Weight-gradient accumulation fusion (models/performance/wgrad_fusion.py, its GEMMs in
fused_kernels/wgrad_accum.py): the GEMM adds into
main_grad exactly what the unfused backward adds, through megatron's real linear layers."""

from __future__ import annotations

import pytest
import torch
from helpers.proxy_fixtures import accumulate, packed_rows, proxy_model, wrap_ddp

from fused_kernels import wgrad_accum
from models.performance import wgrad_fusion


def test_gemm_accumulates_into_main_grad():
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(40, 24, generator=gen), torch.randn(40, 16, generator=gen)
    acc = torch.randn(16, 24, generator=gen)
    want = acc + g.t() @ x
    wgrad_accum.wgrad_gemm_accum_fp32(x, g, acc)
    torch.testing.assert_close(acc, want, rtol=1e-6, atol=1e-6)
    # bf16 activations into an fp32 buffer: the product is not rounded to bf16 first
    xb, gb = x.bfloat16(), g.bfloat16()
    acc2 = torch.zeros(16, 24)
    wgrad_accum.wgrad_gemm_accum_fp32(xb, gb, acc2)
    torch.testing.assert_close(acc2, gb.float().t() @ xb.float(), rtol=1e-6, atol=1e-6)
    half = torch.zeros(16, 24, dtype=torch.bfloat16)
    wgrad_accum.wgrad_gemm_accum_fp16(xb, gb, half)
    torch.testing.assert_close(half.float(), gb.float().t() @ xb.float(), rtol=1e-2, atol=1e-2)


def test_resolve_turns_it_on_only_under_graphs_that_add_into_main_grad(monkeypatch):
    assert wgrad_fusion.resolve(False) is False
    assert wgrad_fusion.resolve(False, True) is False
    assert wgrad_fusion.resolve(None) is False  # eager: measured slower on the H200
    if not torch.cuda.is_available():
        assert wgrad_fusion.resolve(None, True) is False  # no GPU: no graphs, and no gain
        assert wgrad_fusion.resolve(True) is True  # runs on the CPU too (the tests below)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(wgrad_fusion, "unavailable_reason", lambda: None)
    assert wgrad_fusion.resolve(None, True) is True  # graphs adding into main_grad: measured faster
    monkeypatch.setattr(wgrad_fusion, "unavailable_reason", lambda: "torch too old")
    assert wgrad_fusion.resolve(None, True) is False
    with pytest.raises(RuntimeError, match="torch too old"):
        wgrad_fusion.resolve(True)


def _main_grads(ddp, model, batch):
    return accumulate(ddp, model, [batch])[1]


@pytest.mark.parametrize("overrides, vocab_weights, head_grad", [
    ((), 1, "main_grad_only"),  # tied: the embedding's backward returns the one placeholder
    (("model.tie_word_embeddings=false",), 2, "main_grad"),  # untied: each weight its own
    (("model.fused_linear_ce=false",), 1, "main_grad_only"),  # tied, megatron's output layer
    ("deterministic", 1, "main_grad"),  # tied, the lookup unfused: the head's zeros + the dense grad
])
def test_fused_backward_matches_the_ddp_hook_path(mcore, overrides, vocab_weights, head_grad):
    deterministic = overrides == "deterministic"
    cfg, model = proxy_model(() if deterministic else overrides)
    m = cfg.model
    if deterministic:  # megatron's deterministic lookup (weight[ids]) keeps its own backward
        model.language_model.embedding.word_embeddings.deterministic_mode = True
    batch = packed_rows(cfg)[0]
    ddp = wrap_ddp(model)
    plain = _main_grads(ddp, model, batch)
    fused_weights = wgrad_fusion.enable(ddp)
    # every decoder linear (in_proj/out_proj, linear_qkv/linear_proj, linear_fc1/fc2) and the
    # vocabulary weights: the word embedding and the LM head (one weight when tied)
    assert fused_weights == 2 * m.num_layers + 2 * m.num_layers + vocab_weights
    assert model.language_model.lm_head_grad == head_grad
    fused = _main_grads(ddp, model, batch)
    flagged = [n for n, p in model.named_parameters() if getattr(p, "grad_added_to_main_grad", False)]
    assert len(flagged) == fused_weights  # those took the fused path
    assert "language_model.embedding.word_embeddings.weight" in flagged
    for name, g in plain.items():
        assert g.abs().sum() > 0, name
        # fp32 sums in another order (one GEMM over the batch, index_add_ for the lookup's rows):
        # 1e-6 absolute is 1e-7 of the largest gradient entries here
        torch.testing.assert_close(fused[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_vocabulary_gradients_accumulate_over_micro_batches_and_steps(mcore):
    """Two micro-batches add up in main_grad, and the next step starts from zero again (DDP
    resets the buffer and the flag), for the tied embedding / LM head weight."""
    cfg, model = proxy_model()
    batches = packed_rows(cfg, [(0, 1), (2,)])
    ddp = wrap_ddp(model)
    name = "language_model.embedding.word_embeddings.weight"
    plain = accumulate(ddp, model, batches)[1][name]
    one = accumulate(ddp, model, batches[:1])[1][name]
    assert not torch.allclose(one, plain)  # the second micro-batch contributes
    wgrad_fusion.enable(ddp)
    for _ in range(2):
        fused = accumulate(ddp, model, batches)[1][name]
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)


def test_fused_head_refuses_a_weight_without_main_grad():
    from fused_kernels.fused_linear_ce import fused_linear_cross_entropy

    h, w, y = torch.randn(4, 8), torch.randn(16, 8, requires_grad=True), torch.randint(0, 16, (4,))
    with pytest.raises(ValueError, match="main_grad"):
        fused_linear_cross_entropy(h, w, y, weight_grad="main_grad")
    with pytest.raises(ValueError, match="autograd, main_grad or main_grad_only"):
        fused_linear_cross_entropy(h, w, y, weight_grad="dense")
