"""Selective recompute: outputs and every gradient equal the run without it bit for bit, and the
discarded blocks really leave the autograd graph's saved tensors."""

from __future__ import annotations

import pytest
import torch

from helpers.proxy_fixtures import forward, packed_rows, proxy_model

from multimodal.config import ConfigError, load_config, validate
from multimodal.observability.memory import activation_bytes_held
from multimodal.performance.recompute import apply_recompute, check_modules


def _model_and_batch(path, overrides=()):
    cfg, model = proxy_model(overrides, config=path)
    return model, packed_rows(cfg)[0]


def _step(model, batch):
    """Loss and all gradients; also the bytes of distinct storages autograd keeps for backward."""
    model.zero_grad(set_to_none=True)
    # after forward: storages discarded by recompute have been resized to 0 bytes
    loss, held = activation_bytes_held(lambda: forward(model, batch))
    (loss * batch["loss_mask"]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, held


def _assert_bit_exact(a, b, exact=True):
    assert torch.equal(a[0], b[0])  # the forward is always bit-identical
    assert set(a[1]) == set(b[1])
    # relative to each gradient's norm, floored at 1e-3 of the largest (tiny dt_bias gradients)
    floor = 1e-3 * max(g.norm().item() for g in b[1].values())
    for name in a[1]:
        if exact:
            assert torch.equal(a[1][name], b[1][name]), name
        else:
            err = (a[1][name] - b[1][name]).norm().item() / max(b[1][name].norm().item(), floor)
            assert err < 1e-5, (name, err)


# Every module is bit-exact. The norms and the shared expert use their input twice beside other
# consumers (the residual; the router and experts); both enter through one view node
# (models/common/norms.py, model.py _enter_through_one_node) so the gradient is summed in the
# same order with and without recompute.
@pytest.mark.parametrize("modules, exact", [
    (["gdn_qkv"], True), (["gdn_norm_out"], True), (["core_attn"], True),
    (["gdn_qkv", "gdn_norm_out", "core_attn"], True),
    (["layernorm"], True),
    (["gdn_qkv", "gdn_norm_out", "layernorm", "core_attn"], True),
])
def test_dense_recompute_matches_and_saves_memory(mcore, modules, exact):
    model, batch = _model_and_batch("configs/qwen35_vl_proxy.yaml")
    base = _step(model, batch)
    assert apply_recompute(model, modules) > 0
    rec = _step(model, batch)
    _assert_bit_exact(rec, base, exact)
    again = _step(model, batch)  # hooks re-arm every step
    _assert_bit_exact(again, base, exact)
    if modules != ["core_attn"]:  # megatron's core_attn checkpoint keeps q/k/v (SDPA saves little more)
        assert rec[2] < base[2], (modules, rec[2], base[2])
    # eval / no-grad forward runs the plain path
    model.eval()
    with torch.no_grad():
        out = forward(model, batch)
    torch.testing.assert_close(out, base[0], rtol=0, atol=0)


@pytest.mark.parametrize("modules, exact", [
    (["gdn_qkv", "gdn_norm_out"], True),
    (["shared_experts"], True),
    (["moe_act"], True),
    (["shared_experts", "moe_act", "layernorm", "gdn_qkv", "gdn_norm_out"], True),
])
def test_moe_recompute_matches(mcore, modules, exact):
    model, batch = _model_and_batch("configs/qwen35_vl_proxy_moe.yaml", ["model.moe_token_dispatcher=allgather"])
    base = _step(model, batch)
    apply_recompute(model, modules)
    rec = _step(model, batch)
    _assert_bit_exact(rec, base, exact)
    assert rec[2] < base[2]


def test_a_family_without_mixer_blocks_recomputes_the_shared_modules(mcore):
    """tiny_dense_vl (attention mixers, no ``mixer_checkpoints`` hook): layernorm and core_attn
    through the shared code, bit for bit, and no family installs a block in its mixers."""
    model, batch = _model_and_batch("tests/fixtures/tiny_dense_vl.yaml")
    layers = model.config.num_layers
    base = _step(model, batch)
    assert apply_recompute(model, ["layernorm", "core_attn"]) == 3 * layers  # two norms and core_attn a layer
    rec = _step(model, batch)
    _assert_bit_exact(rec, base)
    assert rec[2] < base[2]


def test_recompute_modules_are_validated():
    assert check_modules(["core_attn", "gdn_qkv"]) is None
    assert "unknown" in check_modules(["attn"])
    assert check_modules(["moe_act", "shared_experts"]) is None
    assert "context parallelism" in check_modules(["gdn_qkv"], cp=2)
    with pytest.raises(ConfigError, match="train.recompute_modules"):
        validate(load_config("configs/qwen35_vl_proxy.yaml", ["train.recompute_modules=[bogus]"]))
    validate(load_config("configs/qwen35_vl_proxy.yaml", ["train.recompute_modules=[gdn_qkv,layernorm]"]))


def test_recompute_memory_script_measures_each_module(mcore):
    """scripts/recompute_memory.py: activation bytes per recompute choice, on the CPU."""
    from scripts.recompute_memory import measure

    result = measure("configs/qwen35_vl_proxy.yaml", ["train.seq_length=384", "data.mock.max_text_tokens=96"],
                     torch.float32)
    rows = result["choices"]
    assert set(rows) == {"none", "layernorm", "gdn_qkv", "gdn_norm_out", "core_attn",
                         "core_attn,gdn_norm_out,gdn_qkv,layernorm"}
    assert rows["none"]["activation_gib"] > 0 and rows["none"]["saved_gib"] == 0
    for name in ("layernorm", "gdn_qkv", "gdn_norm_out"):  # discard-output blocks free their outputs
        assert rows[name]["saved_gib"] > 0, name
    everything = rows["core_attn,gdn_norm_out,gdn_qkv,layernorm"]["saved_gib"]
    assert everything >= max(r["saved_gib"] for r in rows.values()) - 1e-9

