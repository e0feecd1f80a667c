"""Parity with transformers' Qwen3.5 / Qwen3.5-MoE, and checkpoint import/export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.hf_fixtures import add_mtp_head, make_hf_checkpoint  # tests/ is on sys.path (conftest)
from models.qwen35_vl.hf import load_hf_state_dict, model_config_from_hf

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {
    "dense_tied": dict(moe=False, tied=True),
    "dense_6layers_interval3_mqa": dict(moe=False, tied=False, layers=6, interval=3, kv_heads=1, k_heads=2, v_heads=2),
    "moe_untied": dict(moe=True, tied=False),
    "moe_8layers_8heads": dict(moe=True, tied=True, layers=8, heads=8, kv_heads=2, k_heads=1, v_heads=4,
                               vision_depth=1),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_parity_with_transformers(shape, tmp_path, mcore):
    from models.qwen35_vl.parity import run_parity

    hf_dir = make_hf_checkpoint(tmp_path / "hf", **SHAPES[shape])
    r = run_parity(hf_dir, "fp32", seed=1)
    assert r["position_ids_equal"], r
    assert r["max_abs_logit_diff"] <= 1e-4, r
    assert r["loss_abs_diff"] <= 1e-5, r
    assert r["max_rel_grad_diff"] <= 1e-3, r
    assert r["num_params_compared"] > 50
    assert r["ok"]


def test_model_config_comes_from_config_json(tmp_path):
    hf_dir = make_hf_checkpoint(tmp_path / "hf", **SHAPES["dense_6layers_interval3_mqa"])
    m = model_config_from_hf(hf_dir)
    assert (m.num_layers, m.full_attention_interval, m.num_query_groups) == (6, 3, 1)
    assert (m.linear_num_key_heads, m.linear_num_value_heads, m.head_dim) == (2, 2, 16)
    assert m.mrope_section == [2, 1, 1] and m.partial_rotary_factor == 0.5
    assert m.vision.depth == 2 and not m.tie_word_embeddings and m.image_token_id == 500
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["text_config"]["layer_types"][0] = "full_attention"
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not a regular"):
        model_config_from_hf(hf_dir)


def _env():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _run(*cmd: str, nproc: int = 1):
    if nproc > 1:
        from test_training import _free_port

        cmd = ("-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={_free_port()}", *cmd)
    proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


# Several script runs in one process: each as ``python SCRIPT ARGS`` would run it (runpy as
# __main__, its exit code from SystemExit), its stdout and stderr in files of its own, megatron's
# parallel state torn down before it as in a fresh process; torch and megatron start once.
_IN_ONE_PROCESS = r"""
import json, os, runpy, sys, traceback
calls, out = json.loads(sys.argv[1]), sys.argv[2]
codes = []
for i, argv in enumerate(calls):
    from megatron.core import parallel_state as ps
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(f"{out}/{i}.out", "w") as o, open(f"{out}/{i}.err", "w") as e:
        os.dup2(o.fileno(), 1); os.dup2(e.fileno(), 2)
        sys.argv = list(argv)
        try:
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as x:
            if x.code is None or isinstance(x.code, int):
                code = x.code or 0
            else:  # sys.exit("message"): printed, exit code 1
                print(x.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
    codes.append(code)
with open(f"{out}/codes.json", "w") as f:
    json.dump(codes, f)
"""


def _run_in_one_process(*calls: tuple[str, ...]) -> list[tuple[int, str, str]]:
    """Each call (script, *args) in turn in one process; (exit code, stdout, stderr) of each."""
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, "-c", _IN_ONE_PROCESS, json.dumps(calls), out], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, proc.stderr[-4000:]
        codes = json.loads(Path(out, "codes.json").read_text())
        return [(code, Path(out, f"{i}.out").read_text(), Path(out, f"{i}.err").read_text())
                for i, code in enumerate(codes)]


def _run_ok(*calls: tuple[str, ...]) -> list[str]:
    """_run_in_one_process where every call must succeed: the stdout of each."""
    ran = _run_in_one_process(*calls)
    for call, (code, _, err) in zip(calls, ran):
        assert code == 0, (call, err[-4000:])
    return [out for _, out, _ in ran]


def _assert_same_tensors(a_dir: Path, b_dir: Path):
    a, b = load_hf_state_dict(a_dir), load_hf_state_dict(b_dir)
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("moe, layout", [(False, "--tp=2"), (True, "--ep=2")])
def test_import_export_round_trip_and_parallel_layouts(moe, layout, tmp_path):
    """import -> export is exact; the checkpoint gives the same logits under TP=2 / EP=2 on two
    gloo processes, and a checkpoint saved under that layout exports to the same HF tensors."""
    from transformers import AutoModelForImageTextToText

    hf_dir = make_hf_checkpoint(tmp_path / "hf", moe=moe, tied=not moe)
    ckpt = tmp_path / "ckpt"
    _run("scripts/convert_hf.py", "import", "--hf-dir", str(hf_dir), "--out", str(ckpt), layout)
    _run("tests/helpers/mp_logits.py", str(ckpt), str(tmp_path / "parallel.pt"), layout,
         "--save-weights", str(tmp_path / "ckpt_parallel"), nproc=2)
    # what reads the two checkpoints, after the parallel run: one process
    _run_ok(("scripts/convert_hf.py", "export", "--ckpt", str(ckpt), "--out", str(tmp_path / "exported")),
            ("tests/helpers/mp_logits.py", str(ckpt), str(tmp_path / "single.pt")),
            ("scripts/convert_hf.py", "export", "--ckpt", str(tmp_path / "ckpt_parallel"),
             "--out", str(tmp_path / "exported_parallel")))
    _assert_same_tensors(hf_dir, tmp_path / "exported")
    AutoModelForImageTextToText.from_pretrained(tmp_path / "exported")  # transformers accepts it

    single, parallel = torch.load(tmp_path / "single.pt"), torch.load(tmp_path / "parallel.pt")
    torch.testing.assert_close(parallel, single, rtol=1e-5, atol=1e-5)
    _assert_same_tensors(hf_dir, tmp_path / "exported_parallel")


@pytest.mark.slow
def test_training_starts_from_converted_weights_and_its_checkpoint_exports(tmp_path):
    hf_dir = make_hf_checkpoint(tmp_path / "hf", moe=False, tied=True)
    ckpt = tmp_path / "imported"
    run = ("pretrain_multimodal.py", "--config", "configs/qwen35_vl_proxy.yaml", "logging.progress_bar=false",
           "train.iters=2", "train.seq_length=256", "data.mock.max_image_side=64", "data.mock.max_text_tokens=48",
           "model.im_start_token_id=504", "model.im_end_token_id=505", "model.eos_token_id=506",
           "model.pad_token_id=507", "optimizer.lr=0", "optimizer.min_lr=0")
    out = tmp_path / "exported"
    # import, train, export, and train again from the HF folder itself: one process, each step as its CLI
    _run_ok(("scripts/convert_hf.py", "import", "--hf-dir", str(hf_dir), "--out", str(ckpt)),
            (*run, f"model.hf_config={hf_dir}", f"checkpoint.load={ckpt}", f"checkpoint.dir={tmp_path / 'trained'}",
             f"logging.dir={tmp_path / 'log'}"),
            ("scripts/convert_hf.py", "export", "--ckpt", str(tmp_path / "trained"), "--out", str(out)),
            # checkpoint.load=<the HF folder> (its config.json the architecture): no import step
            (*run, f"checkpoint.load={hf_dir}", f"checkpoint.dir={tmp_path / 'direct'}",
             f"logging.dir={tmp_path / 'log_direct'}", f"checkpoint.save_hf={tmp_path / 'saved_hf'}"))
    rows = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["loss"] == r["loss"] for r in rows)  # finite
    # lr = 0: the training checkpoint holds exactly the imported weights, so exporting it must give
    # back the original HF tensors (proves the trainer loaded them and that training checkpoints export)
    _assert_same_tensors(hf_dir, out)
    # the run from the HF folder: the same losses
    direct = [json.loads(x) for x in (tmp_path / "log_direct" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in direct] == [r["loss"] for r in rows]
    _assert_same_tensors(hf_dir, tmp_path / "saved_hf")  # checkpoint.save_hf: lr = 0, the weights it loaded


def test_direct_hugging_face_loading_equals_import_under_tp_pp_ep(tmp_path):
    """checkpoint.load=<HF folder> fills every rank's part of the model with the tensors
    import-then-load gives, bit for bit, under TP=2, PP=2 and EP=2 (tests/helpers/mp_hf_load.py)."""
    hf_dir = make_hf_checkpoint(tmp_path / "hf", moe=True, layers=4, tied=True)
    add_mtp_head(hf_dir)
    _run("scripts/convert_hf.py", "import", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "ckpt"))
    out = _run("tests/helpers/mp_hf_load.py", str(hf_dir), str(tmp_path / "ckpt"), "tp=2", "pp=2", "ep=2",
               f"--export={tmp_path / 'exported'}", nproc=2)
    assert [line.split(":")[0] for line in out.splitlines() if "tensors equal" in line] == ["tp=2", "pp=2", "ep=2"]
    _assert_same_tensors(hf_dir, tmp_path / "exported")  # two ranks, each writing its share of the shards
    assert len(json.loads((tmp_path / "exported" / "model.safetensors.index.json").read_text())["weight_map"]) > 0


def _refused(*cmd: str) -> str:
    """The error line of a script run that must end with exit code 2 (a one-line, user-fixable
    error: no traceback; the lines before it are the import warnings of torch and megatron)."""
    proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return proc.stderr.strip().splitlines()[-1]


def test_convert_hf_refuses_a_family_without_a_hugging_face_adapter(tmp_path):
    ckpt = tmp_path / "iter_0000001"  # what export reads before building anything
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text("{}")
    (ckpt / "model_config.json").write_text(json.dumps({"name": "tiny_dense_vl"}))
    err = _refused("scripts/convert_hf.py", "export", "--ckpt", str(ckpt), "--out", str(tmp_path / "out"))
    assert err == ("error: model tiny_dense_vl has no Hugging Face adapter (ModelFamily.hf_adapter); "
                   "Hugging Face conversion and comparison work for ['qwen35_vl']")
    assert not (tmp_path / "out").exists()


def test_convert_hf_import_refuses_an_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    err = _refused("scripts/convert_hf.py", "import", "--hf-dir", str(tmp_path), "--out", str(tmp_path / "ckpt"))
    assert err.startswith("error: Hugging Face model_type 'llama' is read by no registered model family; "
                          "known: [")
