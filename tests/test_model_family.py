"""The model registry as a plug-in point: the trainer's FLOPs and dry-run counts come from the
family registered under the recipe's ``model.name``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import models
from models import MODEL_REGISTRY, get_model_builder, get_model_family
from models.family import ModelFamily, StageParams


def _fake_family() -> ModelFamily:
    return ModelFamily(
        name="fake",
        config_class=SimpleNamespace,
        build=lambda *a, **k: "built",
        training_flops=lambda m, lengths, grids, lm_head_tokens=None, mtp_head_tokens=None: 7.0 * sum(lengths),
        stage_params=lambda m, tp=1, pp=1, ep=1, stage=0: StageParams(stage, {"mixer": 2},
                                                                      {"vision": 5, "dec": 11 // tp}),
        model_params=lambda m: (16, 16),
        activation_bytes_per_token=lambda m, lay: {"mixer": 1.0},
        vision_bytes_per_patch=lambda m: 0.0,
        position_ids=lambda ids, grids, image_token_id, merge: None,
    )


def test_a_registered_family_is_what_the_trainer_dispatches_to(monkeypatch):
    from multimodal import dry_run
    from multimodal.flops import training_flops

    fake = _fake_family()
    monkeypatch.setitem(MODEL_REGISTRY, "fake", fake)
    assert get_model_family("fake") is fake
    assert get_model_builder("fake")() == "built"
    m = SimpleNamespace(name="fake")
    assert training_flops(m, [3, 4], []) == 49.0
    sp = dry_run.stage_params(m, tp=2)
    assert sp.layers == {"mixer": 2} and sp.total == 10
    assert dry_run.model_params(m) == (16, 16)
    # the defaults: no mixer blocks to recompute, no row buffers under the decoder graphs
    assert fake.mixer_checkpoints(object(), ["gdn_qkv"], None) == 0 and fake.recompute_modules_no_cp == ()
    assert fake.graph_row_buffers([], None, 384, 8, False) is None


def test_an_unknown_name_is_a_one_line_error():
    with pytest.raises(KeyError) as err:
        get_model_family("llama")
    msg = err.value.args[0]
    assert msg == "model.name 'llama' is not registered; known: ['qwen35_vl', 'tiny_dense_vl']" and "\n" not in msg


def test_qwen35_vl_is_registered_with_its_family():
    family = models.get_model_family("qwen35_vl")
    assert family.name == "qwen35_vl"
    from models.qwen35_vl import flops, param_counts

    assert family.training_flops is flops.training_flops and family.stage_params is param_counts.stage_params


def test_the_hugging_face_adapter_is_reached_through_the_family(tmp_path):
    import json

    from core.errors import ConfigError
    from models import family_for_hf_config, family_for_hf_model_type, get_hf_adapter

    qwen = get_model_family("qwen35_vl")
    for model_type in ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"):
        assert family_for_hf_model_type(model_type) is qwen
    hf = get_hf_adapter(qwen)
    for member in ("model_config_from_hf", "hf_config_from_ours", "load_hf_state_dict", "hf_to_ours", "ours_to_hf",
                   "lora_to_hf", "load_full_state_dict", "run_parity", "use_hf_torch_kernels", "HF_MODELING_MODULES"):
        assert hasattr(hf, member), member
    with pytest.raises(ConfigError, match=r"^model tiny_dense_vl has no Hugging Face adapter") as err:
        get_hf_adapter(get_model_family("tiny_dense_vl"))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"^Hugging Face model_type 'llama' is read by no registered model family"):
        family_for_hf_model_type("llama")
    # a config.json without a top-level model_type: its text_config's
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"model_type": "qwen3_5_text"}}))
    assert family_for_hf_config(tmp_path) is qwen


def test_packed_row_extras_are_the_familys():
    import torch

    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    assert get_model_family("tiny_dense_vl").packed_row_extras(cu, torch.device("cpu")) == {}
    extras = get_model_family("qwen35_vl").packed_row_extras(cu, torch.device("cpu"))
    assert set(extras) == {"mixer_varlen"} and torch.equal(extras["mixer_varlen"].cu_seqlens, cu.long())


def test_registering_the_families_imports_no_torch():
    """models/family.py's promise: the registry and each family's family, config, validate and count
    modules load without torch or megatron (the dry run and the FLOP count read them)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    names = ["models", "models.family"] + [f"models.{name}.{part}" for name in MODEL_REGISTRY
                                           for part in ("family", "config", "validate")]
    code = (f"import importlib, sys\nfor n in {names!r}: importlib.import_module(n)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron', 'transformers'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
