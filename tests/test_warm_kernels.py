"""multimodal/warm_kernels.py on CPU: which kernels and shapes a recipe's warm-up compiles (per-rank
heads at TP=1/2, the 35B-A3B and 397B-A17B layouts, padded rows, fp32, the fla and unfused
paths), the compile-time keys it covers (FlashQLA's block_DV and split, the cu_seqlens search
depth, CP ranks' parameter alignment), the one-line refusal without a GPU, and the runners'
calls under the Triton interpreter (the synthetic tensors fit the kernel entry points)."""

from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from multimodal import kernel_warmup
from multimodal import warm_kernels as wk
from multimodal.config import load_config

ROOT = Path(__file__).resolve().parents[1]
H200_CTAS = int(132 * 0.7)


def _cfg(recipe: str, *overrides: str):
    return load_config(ROOT / "configs" / recipe, list(overrides))


def _plan(cfg, **setting):
    base = wk.Setting.assumed(cfg)
    return wk.plan(cfg, wk.Setting(**{**base.__dict__, **setting}))


def _families(jobs) -> list[str]:
    return sorted({j.family for j in jobs})


@pytest.mark.parametrize("tp, heads, attn", [(1, 16, (8, 2)), (2, 8, (4, 1))])
def test_2b_shapes_per_rank_at_tp1_and_tp2(tp, heads, attn):
    s = wk.rank_shapes(_cfg("qwen35_vl_2b.yaml", f"parallel.tp={tp}"))
    assert (s.key_heads, s.heads, s.key_dim, s.value_dim, s.cp) == (heads, heads, 128, 128, 1)
    assert (s.attn_heads, s.attn_kv_heads, s.head_dim, s.rot_dim) == (*attn, 256, 64)
    assert (s.seq, s.batch, s.packed, s.dtype) == (8192, 1, True, "bfloat16")
    assert s.graph_cu_entries == 66  # the recipe's CUDA graphs: 64 samples + the padding segment + the end


def test_35b_and_397b_shapes_are_one_cp_head_group_of_one_tp_rank():
    s35 = wk.rank_shapes(_cfg("qwen35_vl_35b_a3b.yaml"))  # tp=2, cp=4: 16 key / 32 value heads
    assert (s35.tp_key_heads, s35.tp_value_heads, s35.key_heads, s35.heads) == (8, 16, 2, 4)
    assert (s35.attn_heads, s35.attn_kv_heads, s35.attn_tokens, s35.seq) == (8, 1, 2048, 8192)
    assert (s35.vision_heads, s35.vision_head_dim) == (16, 72)
    s397 = wk.rank_shapes(_cfg("qwen35_vl_397b_a17b.yaml"))  # tp=2, cp=8: 16 key / 64 value heads
    assert (s397.tp_key_heads, s397.tp_value_heads, s397.key_heads, s397.heads) == (8, 32, 1, 4)
    assert (s397.attn_heads, s397.attn_kv_heads, s397.attn_tokens) == (16, 1, 1024)


def test_the_2b_plan_covers_every_flash_qla_variant_a_packed_row_reaches():
    cfg = _cfg("qwen35_vl_2b.yaml")
    jobs = _plan(cfg)
    assert _families(jobs) == ["flash_qla", "mrope", "pre_gdr"]
    qla = [j for j in jobs if j.family == "flash_qla"]
    assert all(not j.tuning for j in qla) and all(j.tuning for j in jobs if j.family != "flash_qla")
    assert all(j.kwargs["heads"] == 16 and j.kwargs["seq"] == 8192 for j in qla)
    unsplit = [j for j in qla if j.kwargs["max_chunks"] is None]
    split = [j for j in qla if j.kwargs["max_chunks"] is not None]
    # block_DV: FlashQLA's forward picks 32 / 64 / 128 from samples (or pieces) x heads
    assert sorted(wk.qla_block_dv(len(j.kwargs["segments"]), 16, H200_CTAS) for j in unsplit) == [32, 64, 128]
    assert all(sum(j.kwargs["segments"]) == 8192 for j in qla)
    from fused_kernels.flash_qla_gdr import split_pieces

    blocks = []
    for j in split:
        bounds = split_pieces([0, 8192], j.kwargs["max_chunks"])[0]
        blocks.append(wk.qla_block_dv(len(bounds) - 1, 16, H200_CTAS))
    assert sorted(blocks) == [32, 64, 128]


@pytest.mark.parametrize("heads", [1, 4, 8, 16, 48, 64])
def test_block_dv_rows_reach_each_reachable_block(heads):
    """Every block_DV some row count reaches is warmed, each by a row that really reaches it."""
    reachable = {wk.qla_block_dv(n, heads, H200_CTAS) for n in range(1, 200)}
    rows = wk.unsplit_rows(8192, heads, H200_CTAS)
    assert {b for b, _ in rows} == reachable
    assert all(wk.qla_block_dv(len(seg), heads, H200_CTAS) == b for b, seg in rows)
    assert {b for b, _, _ in wk.split_rows(8192, heads, H200_CTAS)} == {
        wk.qla_block_dv(math.ceil(128 / mc), heads, H200_CTAS) for mc in range(1, 129)}


def test_moe_recipes_warm_the_cp_head_group_path_for_both_parameter_alignments():
    for recipe, heads in (("qwen35_vl_35b_a3b.yaml", 4), ("qwen35_vl_397b_a17b.yaml", 4)):
        jobs = _plan(_cfg(recipe))
        pre = next(j for j in jobs if j.family == "pre_gdr")
        # A_log[r*4:(r+1)*4] in bf16 starts 8 bytes off a 16-byte boundary on odd ranks
        assert pre.kwargs["cp_ranks"] == (0, 1) and pre.kwargs["cp"] > 1
        assert {j.kwargs["heads"] for j in jobs if j.family == "flash_qla"} == {heads}
        mrope = next(j for j in jobs if j.runner == "mrope_attention")
        assert mrope.kwargs["kv_heads"] == 1  # 2 query groups over tp=2: Triton specialises on 1
    aligned = wk.rank_shapes(_cfg("qwen35_vl_35b_a3b.yaml", "parallel.cp=2", "parallel.world_size=8"))
    assert aligned.heads == 8 and wk._cp_ranks(aligned) == (0,)  # 8 bf16 = 16 bytes: every slice aligned


def test_rows_cover_each_cu_seqlens_search_depth():
    from fused_kernels.triton_support import cu_steps

    s = wk.rank_shapes(_cfg("qwen35_vl_2b.yaml"))
    assert sorted(cu_steps(len(r) + 1) for r in wk._cu_rows(s)) == [6, 7]
    wide = wk.rank_shapes(_cfg("qwen35_vl_2b.yaml", "train.cuda_graphs.max_samples=200"))
    assert sorted(cu_steps(len(r) + 1) for r in wk._cu_rows(wide)) == [6, 7, 8]


def test_padded_rows_warm_the_dense_kernels_once():
    cfg = _cfg("qwen35_vl_2b.yaml", "data.pack=false", "train.micro_batch_size=4", "train.cuda_graphs=false")
    jobs = _plan(cfg)
    qla = [j for j in jobs if j.family == "flash_qla"]
    assert len(qla) == 1 and qla[0].kwargs["segments"] is None and qla[0].kwargs["batch"] == 4
    pre = next(j for j in jobs if j.family == "pre_gdr")
    assert pre.kwargs["rows"] == [None] and pre.kwargs["batch"] == 4


def test_fp32_fla_and_unfused_choose_the_kernels_those_runs_call():
    fp32 = _plan(_cfg("qwen35_vl_2b.yaml", "train.precision=fp32"))
    assert _families(fp32) == ["fla", "mrope", "pre_gdr"]  # FlashQLA refuses fp32: every call runs fla
    fla = _plan(_cfg("qwen35_vl_2b.yaml", "model.gdn_backend=fla", "model.gdn_pre_impl=unfused"))
    assert _families(fla) == ["conv1d", "fla", "mrope"]
    conv = next(j for j in fla if j.family == "conv1d")
    assert conv.kwargs["channels"] == 2 * 16 * 128 + 16 * 128 and conv.kwargs["width"] == 4
    assert next(j for j in fla if j.family == "fla").kwargs["save_states"] is True
    torch_only = _plan(_cfg("qwen35_vl_2b.yaml", "model.gdn_backend=torch", "model.fused_mrope=false"))
    assert torch_only == []


def test_every_planned_call_matches_its_runner():
    for recipe in ("qwen35_vl_2b.yaml", "qwen35_vl_35b_a3b.yaml", "qwen35_vl_397b_a17b.yaml"):
        for extra in ((), ("model.gdn_backend=fla", "model.gdn_pre_impl=unfused"), ("data.pack=false",)):
            for job in _plan(_cfg(recipe, *extra)):
                inspect.signature(kernel_warmup.RUNNERS[job.runner]).bind(**job.kwargs)


def test_without_a_gpu_it_refuses_in_one_line(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert wk.main(["--config", str(ROOT / "configs" / "qwen35_vl_2b.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: multimodal.warm_kernels needs a CUDA GPU;")
    assert "--dry-list" in err


def test_dry_list_prints_the_plan_without_a_gpu(capsys):
    assert wk.main(["--config", str(ROOT / "configs" / "qwen35_vl_35b_a3b.yaml"), "--dry-list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("warm_kernels plan for") and "per rank: GDN 2 key / 4 value heads" in out[1]
    assert sum(line.split()[0] == "flash_qla" for line in out[2:]) == 6
    assert any("cp head group, ranks 0/1" in line for line in out)


def test_a_bad_recipe_is_one_line(capsys):
    assert wk.main(["--config", str(ROOT / "configs" / "qwen35_vl_2b.yaml"), "--dry-list", "parallel.tp=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "divisible by parallel.tp" in err


def test_summary_has_one_line_per_family_and_the_total():
    jobs = _plan(_cfg("qwen35_vl_2b.yaml"))
    results = [(j, 100.0 + i, 110.0 + i, None if i else "RuntimeError: boom") for i, j in enumerate(jobs)]
    lines = wk.summary(results, started=100.0, before={"TileLang": 1}, after={"TileLang": 9})
    assert [line.split()[0] for line in lines] == ["flash_qla", "pre_gdr", "mrope", "total"]  # wk.FAMILIES order
    assert "1 FAILED" in lines[1] and "FAILED" not in lines[0] and "+8 TileLang" in lines[-1]


def test_runners_drive_the_entry_points_under_the_triton_interpreter():
    """The pre-GDR (whole projection, padded, CP head groups) and rotary runners on tiny shapes, on
    CPU: the synthetic tensors fit the kernels' entry points, forward and backward."""
    script = """
from multimodal import kernel_warmup as kw
gdn = dict(tp_key_heads=2, tp_value_heads=4, key_dim=8, value_dim=8, conv_width=4, dtype="float32")
calls = [
    ("pre_gdr", dict(gdn, seq=64, batch=1, cp=2, cp_ranks=(0, 1), rows=[(20, 20, 24)])),
    ("pre_gdr", dict(gdn, seq=32, batch=2, cp=1, cp_ranks=(0,), rows=[None])),
    ("pre_gdr", dict(gdn, seq=64, batch=1, cp=1, cp_ranks=(0,), rows=[(30, 34)])),
    ("mrope_attention", dict(tokens=16, batch=1, heads=2, kv_heads=1, head_dim=16, rot_dim=8, theta=1e4,
                             section=(2, 1, 1), interleaved=True, dtype="float32")),
    ("vision_rotary", dict(patches=16, heads=2, head_dim=8, theta=1e4, dtype="float32")),
]
errors = [r[2] for r in kw.run_jobs(calls, "cpu")]
print(errors)
assert errors == [None] * len(calls), errors
"""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.parametrize("warm, expect", [(None, "--ntasks-per-node=1"), ("first", "--nodes=1 --ntasks=1"), ("0", None)])
def test_sbatch_warms_the_kernels_before_training(tmp_path, warm, expect):
    """train.sbatch with stand-ins for scontrol, srun and python: the warm-up runs once per node (or
    on the first node, or not at all) before the torchrun of training, with the recipe and overrides."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'gpu-a\\ngpu-b\\n'\n")
    # srun: log its own options, then run the command
    (bin_dir / "srun").write_text(f'#!/bin/bash\nopts=()\nwhile [[ "$1" == --* ]]; do opts+=("$1"); shift; done\n'
                                  f'echo "srun ${{opts[*]}}" >> {tmp_path}/calls\nSLURM_NODEID=0 exec "$@"\n')
    (bin_dir / "python").write_text(f'#!/bin/bash\necho "python $*" >> {tmp_path}/calls\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"), "SLURM_SUBMIT_DIR": str(ROOT),
                "SLURM_JOB_ID": "9", "SLURM_JOB_NAME": "j", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu-[a-b]",
                "DRY_RUN": "0", "RUN_ROOT": str(tmp_path / "runs")})
    if warm is not None:
        env["WARM_KERNELS"] = warm
    proc = subprocess.run(["bash", "scripts/slurm/qwen35_vl_35b_a3b.sbatch", "train.iters=5"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert "torch.distributed.run" in calls[-1]
    if expect is None:
        assert len(calls) == 2 and "multimodal.warm_kernels" not in "".join(calls)
        return
    srun, warm_call = calls[0], calls[1]
    assert srun.startswith(f"srun {expect} ") and "warm_kernels_node%n.log" in srun
    assert warm_call.startswith("python -m multimodal.warm_kernels --config configs/qwen35_vl_35b_a3b.yaml train.iters=5")
    assert "logging.dir=" in warm_call
