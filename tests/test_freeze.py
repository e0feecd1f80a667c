"""model.freeze: frozen parts keep no gradient buffer and no optimizer state and stay bit-identical
through training; the rest trains; bad requests are refused naming the fix; the dry run counts it."""

from __future__ import annotations

import pytest
import torch

from helpers.proxy_fixtures import optimizer_steps

from models.base import PARAMETER_GROUPS
from multimodal.config import ConfigError, load_config, validate

PROXY = "configs/qwen35_vl_proxy.yaml"
MOE = "configs/qwen35_vl_proxy_moe.yaml"


def _train_steps(mcore, config: str, freeze: list[str], steps: int = 3):
    """(model, ddp, optimizer, weights before, weights after) of a few optimizer steps."""
    from core.seeding import seed_everything
    from multimodal.training import build_model_and_optimizer

    cfg = load_config(config, [f"model.freeze=[{','.join(freeze)}]", "optimizer.lr=1e-2",
                               "optimizer.warmup_iters=0"])
    validate(cfg)
    seed_everything(0)
    model, ddp, optimizer, scheduler = build_model_and_optimizer(cfg, mcore, torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer_steps(cfg, model, ddp, optimizer, scheduler, steps)
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return model, ddp, optimizer, before, after


@pytest.mark.parametrize("config,freeze", [
    (PROXY, ["vision", "merger"]),
    (PROXY, ["language", "embedding", "lm_head"]),
    (MOE, ["vision", "language"]),  # routed experts, router and shared expert frozen with the decoder
])
def test_frozen_parts_stay_bit_identical_and_hold_no_state(mcore, config, freeze):
    model, ddp, optimizer, before, after = _train_steps(mcore, config, freeze)
    groups = {n: model.parameter_group(n) for n, _ in model.named_parameters()}
    # every group exists (the dense proxy ties the LM head to the embedding: no lm_head weight)
    # (no MTP head here: model.mtp_num_layers=0; tests/test_mtp.py freezes it)
    assert set(groups.values()) == set(PARAMETER_GROUPS) - {"mtp"} - ({"lm_head"} if model.share_embeddings_and_output_weights
                                                                      else set())
    frozen = [n for n, g in groups.items() if g in freeze]
    trained = [n for n, g in groups.items() if g not in freeze]
    assert frozen and trained
    for n in frozen:  # every one of them, position and patch embeddings included
        assert torch.equal(before[n], after[n]), n
    assert sum(not torch.equal(before[n], after[n]) for n in trained) > 0.9 * len(trained)
    params = dict(model.named_parameters())
    # no gradient buffer: DDP gives frozen weights no main_grad, the optimizer never sees them
    assert all(getattr(params[n], "main_grad", None) is None for n in frozen)
    assert all(params[n].main_grad is not None for n in trained)
    inner = optimizer.optimizer  # the torch optimizer megatron wraps (fp32 on the CPU: the model's own params)
    optimized = [p for group in inner.param_groups for p in group["params"]]
    trained_numel = sum(params[n].numel() for n in trained)
    assert sum(p.numel() for p in optimized) == trained_numel
    assert not {id(params[n]) for n in frozen} & {id(p) for p in optimized}
    state_numel = sum(t.numel() for st in inner.state.values() for t in st.values() if torch.is_tensor(t) and t.dim())
    assert state_numel == 2 * trained_numel  # Adam's m and v, for the trained weights only


def test_freeze_requests_are_checked():
    def refused(overrides, needle):
        with pytest.raises(ConfigError, match=needle):
            validate(load_config(PROXY, overrides))

    refused(["model.freeze=[vision_tower]"], r"model.freeze: unknown group\(s\) \['vision_tower'\]")
    refused([f"model.freeze=[{','.join(PARAMETER_GROUPS)}]"], "nothing would train")
    refused(["model.freeze=[embedding]", "model.tie_word_embeddings=true"], "freeze both or neither")
    validate(load_config(PROXY, ["model.freeze=[vision,merger]", "train.cuda_graphs=true"]))  # graphs replay it
    validate(load_config(PROXY, ["model.freeze=[embedding,lm_head]", "model.tie_word_embeddings=true"]))


def test_dry_run_counts_frozen_weights_out_of_grads_and_optimizer():
    from multimodal.dry_run import check_layout, stage_memory, stage_params

    def memory(freeze):
        cfg = load_config("configs/qwen35_vl_2b.yaml", [f"model.freeze=[{','.join(freeze)}]",
                                                        "train.cuda_graphs=false"])
        lay, _ = check_layout(cfg, 1)
        sp = stage_params(cfg.model, lay.tp, lay.pp, lay.ep, 0)
        return sp, stage_memory(cfg, lay, sp)

    full_sp, full = memory([])
    sp, frozen = memory(["vision", "merger"])
    from models.qwen35_vl.param_counts import vision_params

    assert sp.frozen == vision_params(load_config("configs/qwen35_vl_2b.yaml").model) and full_sp.frozen == 0
    gib = 2**30
    assert full.grads - frozen.grads == pytest.approx(4 * sp.frozen / gib)  # fp32 gradient
    assert full.optimizer - frozen.optimizer == pytest.approx(12 * sp.frozen / gib)  # main params + m + v
    assert frozen.weights == full.weights and frozen.activations < full.activations


def test_frozen_linears_take_a_2d_input(mcore, monkeypatch):
    """A frozen megatron linear given [S, 1, H] with a transposed layout (the GDN in_proj input)
    reaches its GEMM as [S, H] (torch < 2.12 ran such a matmul as S one-row products,
    models/common/frozen_linear.py), with the outputs and input gradients of the plain product,
    for a column- and a row-parallel layer."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import layers

    from models.common.frozen_linear import fold_frozen_linear_inputs

    fold_frozen_linear_inputs()
    seen = []
    real_apply = layers.LinearWithFrozenWeight.apply
    monkeypatch.setattr(layers.LinearWithFrozenWeight, "apply",
                        lambda input, *args: (seen.append(input.dim()), real_apply(input, *args))[1])
    config = ModelParallelConfig(perform_initialization=False)
    init = torch.nn.init.normal_
    column = layers.ColumnParallelLinear(24, 40, config=config, init_method=init, bias=False, gather_output=False)
    row = layers.RowParallelLinear(40, 24, config=config, init_method=init, bias=False, input_is_parallel=True,
                                   skip_bias_add=True)
    for layer in (column, row):
        layer.weight.requires_grad_(False).normal_()
        x = torch.randn(1, 16, layer.weight.shape[1], dtype=torch.float64).transpose(0, 1).requires_grad_(True)
        y, _ = layer(x.float())
        assert y.shape == (16, 1, layer.weight.shape[0])
        expected = x.detach().float() @ layer.weight.t()
        torch.testing.assert_close(y, expected)
        (y * torch.arange(y.numel()).view(y.shape)).sum().backward()
        grad = torch.arange(y.numel(), dtype=torch.float32).view(16, -1) @ layer.weight
        torch.testing.assert_close(x.grad.float().view(16, -1), grad)
    assert seen == [2, 2]


def test_training_flops_count_the_passes_frozen_parts_run():
    """MFU's FLOPs: 3 x forward for what trains; a frozen weight's backward computes only its
    input gradient, and nothing runs backward below the lowest trained part."""
    import copy

    from models.common.training_passes import TrainingPasses
    from models.qwen35_vl.flops import decoder_flops_per_token, vision_flops
    from multimodal.flops import training_flops

    m = load_config("configs/qwen35_vl_2b.yaml").model
    lengths, grids = [8192], [(1, 28, 28)]
    per_token, per_pair = decoder_flops_per_token(m)
    forward = per_token * 8192 + per_pair * 8192 * 8193 / 2 + vision_flops(m, grids)
    assert training_flops(m, lengths, grids) == pytest.approx(3 * forward, rel=1e-12)

    def passes(**changes):
        c = copy.deepcopy(m)
        for key, value in changes.items():
            if key == "rank":
                c.lora.rank = value
            else:
                setattr(c, key, value)
        p = TrainingPasses.of(c)
        return (p.decoder_weights, p.decoder_core, p.lm_head, p.vision, p.merger), training_flops(c, lengths, grids)

    assert passes()[0] == (3, 3, 3, 3, 3)
    # LoRA: base weights frozen, adapters in every layer: input gradients through the decoder only
    (lora, lora_flops) = passes(rank=16)
    assert lora == (2, 3, 2, 1, 1) and lora_flops < 0.7 * 3 * forward
    assert passes(freeze=["vision"])[0] == (3, 3, 3, 1, 2)  # the merger trains, the blocks run forward only
    assert passes(freeze=["vision", "merger"])[0] == (3, 3, 3, 1, 1)
    # the decoder frozen under a trained encoder: its backward still runs, for the input gradients
    assert passes(freeze=["language", "embedding", "lm_head"])[0] == (2, 3, 2, 3, 3)
    # only the LM head trains: its forward and weight gradient, nothing backward below it
    assert passes(freeze=["vision", "merger", "language", "embedding"])[0] == (1, 1, 2, 1, 1)
