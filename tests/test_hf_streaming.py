"""Streaming Hugging Face conversion: the MTP head in and out bit for bit, sharded output with an
index, nothing dropped in silence, and peak memory that does not grow with depth."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.hf_fixtures import add_mtp_head, make_hf_checkpoint

from core.safetensors_io import SafetensorsFolder

ROOT = Path(__file__).resolve().parents[1]


def _all(folder: Path) -> dict[str, torch.Tensor]:
    f = SafetensorsFolder(folder)
    return {n: f.get(n) for n in f.names}


def _same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_mtp_head_round_trips_bit_exact_through_sharded_export(moe, tmp_path, mcore):
    from multimodal import checkpointing
    from scripts import convert_hf

    hf_dir = make_hf_checkpoint(tmp_path / "hf", moe=moe, layers=4, tied=not moe)
    mtp = add_mtp_head(hf_dir)
    ckpt = convert_hf.do_import(str(hf_dir), str(tmp_path / "ckpt"), 1, 1, 1, workers=2)
    out = convert_hf.do_export(str(tmp_path / "ckpt"), str(tmp_path / "out"), None, "auto", workers=2,
                               shard_size="100KB")
    _same(_all(hf_dir), _all(out))
    if moe:  # experts read and written in groups (4 experts: groups of 3 and 1)
        from models import get_hf_adapter, get_model_family
        from multimodal.hf_convert import export_hf

        m = convert_hf.model_config_of_checkpoint(ckpt, None)
        family = get_model_family(m.name)
        export_hf(ckpt, tmp_path / "grouped", m, get_hf_adapter(family), family, None, {}, 100_000, expert_group=3)
        _same(_all(hf_dir), _all(tmp_path / "grouped"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum((out / f).stat().st_size for f in files)
    assert json.loads((out / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    for f in [*out.iterdir(), *ckpt.iterdir()]:
        if f.is_file():
            assert f.stat().st_mode & 0o777 == 0o644, f
    # the conventions, not just a round trip: vLLM's names land on megatron's MTP block
    m = convert_hf.model_config_of_checkpoint(ckpt, None)
    assert m.mtp_num_layers == 1
    model = convert_hf._build(m)
    checkpointing.load_weights(ckpt, model)
    ours = model.state_dict()
    p = "language_model.mtp.layers.0."
    for name, hf_name in [("eh_proj.weight", "mtp.fc.weight"), ("enorm.weight", "mtp.pre_fc_norm_embedding.weight"),
                          ("hnorm.weight", "mtp.pre_fc_norm_hidden.weight"), ("final_layernorm.weight", "mtp.norm.weight"),
                          ("transformer_layer.self_attention.linear_proj.weight", "mtp.layers.0.self_attn.o_proj.weight")]:
        assert torch.equal(ours[p + name], mtp[hf_name].float()), name


def test_untrained_mtp_head_is_carried_over_or_refused(tmp_path, mcore):
    from scripts import convert_hf

    hf_dir = make_hf_checkpoint(tmp_path / "hf", layers=4)
    add_mtp_head(hf_dir)
    ckpt = convert_hf.do_import(str(hf_dir), str(tmp_path / "ckpt"), 1, 1, 1)
    # a run with model.mtp_num_layers=0 records it; its checkpoint then holds no trained head
    recorded = json.loads((ckpt / "model_config.json").read_text())
    (ckpt / "model_config.json").write_text(json.dumps({**recorded, "mtp_num_layers": 0}))
    out = convert_hf.do_export(str(ckpt), str(tmp_path / "out"), None, "auto")
    _same(_all(hf_dir), _all(out))  # the head comes from the source folder, unchanged
    (ckpt / "trainer_state.json").write_text(json.dumps({"iteration": 0, "weights_only": True}))
    (ckpt / "model_config.json").write_text(json.dumps({**recorded, "mtp_num_layers": 0, "hf_config": None}))
    with pytest.raises(ValueError, match="--drop-mtp"):
        convert_hf.do_export(str(ckpt), str(tmp_path / "out2"), None, "auto")
    out = convert_hf.do_export(str(ckpt), str(tmp_path / "out3"), None, "auto", drop_mtp=True)
    assert not any(n.startswith("mtp.") for n in SafetensorsFolder(out).names)
    assert json.loads((out / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 0


def test_import_refuses_a_tensor_it_cannot_map(tmp_path):
    from safetensors.torch import save_file

    hf_dir = make_hf_checkpoint(tmp_path / "hf", layers=4)
    state = load_file(str(hf_dir / "model.safetensors"))
    state["model.language_model.layers.0.mlp.extra_bias"] = torch.zeros(4)
    save_file(state, str(hf_dir / "model.safetensors"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "scripts/convert_hf.py", "import", "--hf-dir", str(hf_dir), "--out",
                           str(tmp_path / "ckpt")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "model.language_model.layers.0.mlp.extra_bias" in last
    assert not (tmp_path / "ckpt" / "latest").exists()


def _synthetic_moe(layers: int):
    from models.qwen35_vl.config import ModelConfig, VisionConfig

    return ModelConfig(hidden_size=512, num_layers=layers, num_attention_heads=4, num_query_groups=2, head_dim=64,
                       ffn_hidden_size=512, vocab_size=2048, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=64, linear_value_head_dim=64, num_experts=16, moe_router_topk=2,
                       moe_ffn_hidden_size=512, moe_shared_expert_intermediate_size=512, tie_word_embeddings=False,
                       mrope_section=[4, 2, 2],
                       vision=VisionConfig(depth=1, hidden_size=64, intermediate_size=128, num_heads=2,
                                           num_position_embeddings=64))


def test_conversion_memory_does_not_grow_with_depth(tmp_path, mcore):
    """Import and export at 2 and 6 layers of one MoE model: the peak grows by less than one
    layer's share (in-memory conversion held the model ~4.5 times over)."""
    from models import get_hf_adapter, get_model_family
    from multimodal.hf_convert import write_random_hf
    from scripts import convert_hf

    convert_hf._init()  # the seeded RNG streams a model build needs

    family = get_model_family("qwen35_vl")
    adapter = get_hf_adapter(family)
    peaks, sizes = {}, {}
    for layers in (2, 6):
        m = _synthetic_moe(layers)
        hf_dir = tmp_path / f"hf{layers}"
        sizes[layers] = write_random_hf(m, adapter, family, hf_dir, max_shard_bytes=16 * 10**6)["bytes"]
        proc = subprocess.run([sys.executable, "tests/helpers/convert_memory.py", str(hf_dir), str(tmp_path / f"w{layers}")],
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        peaks[layers] = json.loads(proc.stdout.strip().splitlines()[-1])
    layer_share = (sizes[6] - sizes[2]) / 4
    for phase in ("import_peak_bytes", "export_peak_bytes"):
        growth = peaks[6][phase] - peaks[2][phase]
        assert growth < layer_share, (phase, growth, layer_share, peaks)


def test_transformers_fused_expert_layout_imports_and_exports_as_the_per_expert_one(tmp_path, mcore):
    """A folder written from transformers' in-memory MoE (``experts.gate_up_proj`` [E, 2F, H],
    ``experts.down_proj`` [E, H, F], the layout its own state_dict holds) gives the same weights as
    the released per-expert layout, and export writes the released layout (the one vLLM and SGLang read)."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText

    from multimodal import checkpointing
    from scripts import convert_hf

    per_expert = make_hf_checkpoint(tmp_path / "hf", moe=True, layers=4, tied=False)
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(per_expert / "config.json", fused / "config.json")
    state = AutoModelForImageTextToText.from_pretrained(str(per_expert), dtype="auto").state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)  # transformers' own layout, not ours
    save_file({k: v.contiguous() for k, v in state.items()}, str(fused / "model.safetensors"))

    weights = {}
    for name, folder in (("per_expert", per_expert), ("fused", fused)):
        ckpt = convert_hf.do_import(str(folder), str(tmp_path / f"ckpt_{name}"), 1, 1, 1)
        model = convert_hf._build(convert_hf.model_config_of_checkpoint(ckpt, None))
        checkpointing.load_weights(ckpt, model)
        weights[name] = model.state_dict()
    assert sorted(weights["fused"]) == sorted(weights["per_expert"])
    for k, v in weights["per_expert"].items():
        if torch.is_tensor(v):
            assert torch.equal(weights["fused"][k], v), k
    out = convert_hf.do_export(str(tmp_path / "ckpt_fused"), str(tmp_path / "out"), None, "auto")
    _same(_all(per_expert), _all(out))
