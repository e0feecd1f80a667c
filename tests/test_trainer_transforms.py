"""The Trainer's model transforms: the real list satisfies every declared constraint, a misordered
list is refused at start naming both transforms, a transform slotted in later is one class plus one
list entry, and a build applies exactly the transforms the config asks for, in order, one log line each."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from models.common.lora import is_adapter_param
from multimodal import transforms
from multimodal.config import ConfigError, load_config
from multimodal.transforms import TRANSFORMS, ModelTransform, check_order

PROXY = "configs/qwen35_vl_proxy.yaml"
SMALL = ["model.num_layers=1", "model.full_attention_interval=1", "model.vision.depth=1"]


def _names(ts) -> list[str]:
    return [t.name for t in ts]


def _moved(name: str, before: str) -> list[ModelTransform]:
    """TRANSFORMS with ``name`` taken out and put back just before ``before``."""
    ts = [t for t in TRANSFORMS if t.name != name]
    at = _names(ts).index(before)
    return ts[:at] + [next(t for t in TRANSFORMS if t.name == name)] + ts[at:]


def test_the_real_list_is_ordered_and_every_constraint_names_a_member():
    check_order(TRANSFORMS)  # must not raise
    names = _names(TRANSFORMS)
    for t in TRANSFORMS:
        for other in [*t.after, *t.before]:
            assert other in names, (t.name, other)
        for other in t.after:
            assert names.index(other) < names.index(t.name)
        assert all(why.strip() for why in [*t.after.values(), *t.before.values()])  # each says why
    # the constraints that keep the run correct are declared, not only satisfied by luck
    declared = {(t.name, other) for t in TRANSFORMS for other in t.after}
    assert {("lora", "freeze"), ("ddp", "freeze"), ("ddp", "lora"), ("ddp", "layout_init"),
            ("wgrad_fusion", "ddp"), ("decoder_graphs", "wgrad_fusion"), ("vision_graphs", "wgrad_fusion")} <= declared


@pytest.mark.parametrize("name,before,needle", [
    ("ddp", "lora", "model transform 'ddp' must come after 'lora'"),
    ("lora", "freeze", "model transform 'lora' must come after 'freeze'"),
    ("decoder_graphs", "wgrad_fusion", "model transform 'decoder_graphs' must come after 'wgrad_fusion'"),
    ("wgrad_fusion", "ddp", "model transform 'wgrad_fusion' must come after 'ddp'"),
])
def test_a_misordered_list_is_refused_in_one_line_naming_both(name, before, needle):
    with pytest.raises(RuntimeError) as e:
        check_order(_moved(name, before))
    message = str(e.value)
    assert needle in message and "\n" not in message, message


class _WeightConversion(ModelTransform):
    """What a later transform declares: after the adapters exist, before DDP allocates buffers."""
    name = "weight_conversion"
    after = {"lora": "adapters convert too"}
    before = {"ddp": "DDP's buffers take the converted weights"}


def test_a_new_transform_is_one_class_and_one_list_entry():
    names = _names(TRANSFORMS)
    good = [*TRANSFORMS[:names.index("ddp")], _WeightConversion(), *TRANSFORMS[names.index("ddp"):]]
    check_order(good)
    late = [*TRANSFORMS, _WeightConversion()]  # its `before` names a transform already passed
    with pytest.raises(RuntimeError, match=r"'weight_conversion' must come before 'ddp' \(DDP's buffers"):
        check_order(late)
    no_ddp = [t for t in good if t.name not in ("fp8", "ddp", "wgrad_fusion", "decoder_graphs", "vision_graphs")]
    with pytest.raises(RuntimeError, match="'weight_conversion' must come before 'ddp', which is not in the list"):
        check_order(no_ddp)
    with pytest.raises(RuntimeError, match="appears twice"):
        check_order([*TRANSFORMS, TRANSFORMS[0]])


def test_the_trainer_refuses_a_misordered_list_before_building(mcore, monkeypatch):
    from multimodal.trainer import Trainer

    monkeypatch.setattr(transforms, "TRANSFORMS", tuple(_moved("ddp", "freeze")))
    with pytest.raises(RuntimeError, match="'ddp' must come after 'freeze'"):
        Trainer(load_config(PROXY, SMALL), mcore)


def test_the_plan_follows_the_config_and_refuses_what_cannot_run_here(mcore):
    plan = transforms.plan(load_config(PROXY, SMALL), mcore)
    assert _names(plan) == ["layout_init", "freeze", "ddp"]  # CPU, no LoRA, no recompute, no graphs
    cfg = load_config(PROXY, [*SMALL, "model.lora.rank=4", "train.recompute_modules=[core_attn]", "model.init=megatron"])
    assert _names(transforms.plan(cfg, mcore)) == ["freeze", "lora", "recompute", "ddp"]
    with pytest.raises(ConfigError, match=r"^train.cuda_graphs=true needs a GPU; set it to false here$"):
        transforms.plan(load_config(PROXY, [*SMALL, "train.cuda_graphs=true"]), mcore)


def test_a_build_applies_the_plan_in_order_one_line_each(mcore, caplog):
    from multimodal.trainer import build_model

    cfg = load_config(PROXY, [*SMALL, "model.lora.rank=4", "train.recompute_modules=[core_attn]"])
    with caplog.at_level(logging.INFO, logger="multimodal.transforms"):
        built, optimizer, _ = build_model(cfg, mcore, torch.float32)
    lines = [r.getMessage() for r in caplog.records if r.name == "multimodal.transforms"]
    wanted = ["layout_init", "freeze", "lora", "recompute", "ddp"]
    skipped = [t.name for t in TRANSFORMS if t.name not in wanted]
    assert lines[0] == f"model transforms, in order: {', '.join(wanted)} (not wanted by this config: {', '.join(skipped)})"
    assert [re.match(r"model transform (\w+): ", x).group(1) for x in lines[1:]] == \
        ["layout_init", "freeze", "lora", "recompute", "ddp"]
    assert all("\n" not in x for x in lines)
    (chunk,), (ddp,) = built.chunks, built.ddp
    assert ddp.module is chunk
    # DDP came after LoRA: exactly the adapters have gradient buffers, the frozen base weights none
    trained = {n for n, p in chunk.named_parameters() if p.requires_grad}
    assert trained and all(is_adapter_param(n) for n in trained)
    assert all((getattr(p, "main_grad", None) is not None) == (n in trained) for n, p in chunk.named_parameters())
    chunk.config.finalize_model_grads_func = None  # the session's model-parallel state is shared
