"""--dry-run: exact per-rank parameter counts (against the real model), recipe layouts, layout refusals.

Run as a script under torchrun it is the worker that builds the real proxies under TP/PP/EP = 2
and reports what every rank holds:
    torchrun --nproc-per-node 2 tests/test_dry_run.py OUT.json
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

from multimodal.config import ConfigError, load_config
from multimodal.dry_run import check_layout, model_params, stage_params  # noqa: E402

DENSE, MOE = "configs/qwen35_vl_proxy.yaml", "configs/qwen35_vl_proxy_moe.yaml"
TINY = "tests/fixtures/tiny_dense_vl.yaml"  # the registry's second family (models/tiny_dense_vl/)
BIG = ["configs/qwen35_vl_9b.yaml", "configs/qwen35_vl_35b_a3b.yaml", "configs/qwen35_vl_397b_a17b.yaml"]
# (recipe, tp, pp, ep) built by the 2-process worker; every layout uses both ranks
MP_LAYOUTS = [(DENSE, 2, 1, 1), (DENSE, 1, 2, 1), (MOE, 2, 1, 1), (MOE, 1, 1, 2), (MOE, 1, 2, 1),
              (DENSE, 1, 2, 1, "model.tie_word_embeddings=false"), (TINY, 2, 1, 1),
              (TINY, 1, 2, 1, "model.tie_word_embeddings=false")]


def _env():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _cli(*args):
    return subprocess.run([sys.executable, "pretrain_multimodal.py", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------- counts vs the real model


@pytest.mark.parametrize("path", [DENSE, MOE, TINY])
def test_count_equals_real_model_single_rank(mcore, path):
    import torch

    from models import get_model_builder
    from core.seeding import seed_everything

    cfg = load_config(path)
    seed_everything(0)
    model = get_model_builder(cfg.model.name)(cfg.model, cfg.parallel, torch.float32)
    real = sum(p.numel() for p in model.parameters())
    counted = stage_params(cfg.model)
    assert counted.total == real
    assert model_params(cfg.model)[0] == real
    # the per-component split matches the real modules too
    vision = sum(p.numel() for p in model.vision_model.parameters())
    assert counted.parts["vision"] == vision
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert counted.expert == experts


def test_count_equals_real_model_per_rank_under_tp_pp_ep(tmp_path):
    """Two gloo processes build the proxies under TP=2, PP=2, EP=2 (and expert-TP=2): every rank
    holds exactly what the dry run says its stage holds."""
    out = tmp_path / "counts.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}",
         "tests/test_dry_run.py", str(out)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads(out.read_text())
    assert len(results) == len(MP_LAYOUTS)
    for (path, tp, pp, ep, *over), ranks in zip(MP_LAYOUTS, results):
        m = load_config(path, over).model
        for r in ranks:
            want = stage_params(m, tp, pp, ep, r["pp_rank"])
            assert r["params"] == want.total, (path, tp, pp, ep, over, r, want.parts)
            assert r["expert"] == want.expert, (path, tp, pp, ep, over, r, want.parts)


def _worker(out: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from models import get_model_builder
    from models.common.parallel_config import ParallelConfig
    from multimodal.platform import init_distributed
    from core.seeding import seed_everything

    init_distributed()
    results = []
    for path, tp, pp, ep, *over in MP_LAYOUTS:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep)
        seed_everything(0)
        cfg = load_config(path, over)
        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        model = get_model_builder(cfg.model.name)(cfg.model, ParallelConfig(tp=tp, pp=pp, ep=ep), torch.float32,
                                                  pre_process=first, post_process=last)
        mine = {"pp_rank": ps.get_pipeline_model_parallel_rank(),
                "params": sum(p.numel() for p in model.parameters()),
                "expert": sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        results.append(gathered)
        ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()


# ---------------------------------------------------------------- model sizes


@pytest.mark.parametrize("path, total, active", [
    ("configs/qwen35_vl_2b.yaml", 2.21e9, None),  # 2213M counted by the trainer on an H200 (docs/performance.md)
    ("configs/qwen35_vl_9b.yaml", 9.4e9, None),
    ("configs/qwen35_vl_35b_a3b.yaml", 35e9, 3),
    ("configs/qwen35_vl_397b_a17b.yaml", 397e9, 17),
])
def test_recipe_sizes_match_their_names(path, total, active):
    got_total, got_active = model_params(load_config(path).model)
    assert got_total == pytest.approx(total, rel=0.01)
    if active:
        # every parameter a token passes through (vision and both embeddings included): 3.90B and
        # 17.81B, whose whole billions are the names' A3B / A17B
        assert int(got_active // 1e9) == active


def test_memory_estimate_follows_the_layout():
    """1F1B keeps pp - stage micro-batches in flight; CP divides a middle stage's activations;
    the distributed optimizer divides optimizer states by the data-parallel sizes."""
    from multimodal.dry_run import stage_memory

    def stage1(*over):
        cfg = load_config("configs/qwen35_vl_397b_a17b.yaml", list(over))
        lay, _ = check_layout(cfg, cfg.parallel.world_size)
        return lay, stage_memory(cfg, lay, stage_params(cfg.model, lay.tp, lay.pp, lay.ep, 1))

    lay, mem = stage1()
    assert [lay.in_flight(s) for s in range(4)] == [4, 3, 2, 1]
    _, half_cp = stage1("parallel.cp=4", "parallel.world_size=256")  # same dp, twice the tokens per rank
    assert half_cp.activations == pytest.approx(2 * mem.activations)
    _, no_dist = stage1("parallel.use_distributed_optimizer=false")
    assert no_dist.weights == mem.weights and no_dist.grads == mem.grads == 2 * mem.weights
    assert no_dist.optimizer == pytest.approx(6 * mem.weights)  # 12 bytes per parameter, unsharded
    assert mem.optimizer < no_dist.optimizer / lay.edp * 1.01


def test_moe_overlap_holds_one_more_micro_batch():
    """The combined 1F1B schedule of parallel.moe_a2a_overlap keeps micro-batch i+1's forward
    alive beside i's backward (measured: +52% peak on two H200s)."""
    from multimodal.dry_run import stage_memory

    def est(*over):
        cfg = load_config("configs/qwen35_vl_35b_a3b.yaml", ["parallel.pp=1", *over])
        lay, _ = check_layout(cfg, cfg.parallel.world_size)
        return lay, stage_memory(cfg, lay, stage_params(cfg.model, lay.tp, lay.pp, lay.ep, 0))

    lay, off = est()
    lay_on, on = est("parallel.moe_a2a_overlap=true")
    assert lay.num_microbatches >= 2, lay
    assert (lay.in_flight(0), lay_on.in_flight(0)) == (1, 2)
    # the layers' activations double; the loss path's one-micro-batch working set does not
    assert 1.8 * off.activations < on.activations < 2 * off.activations


def test_pipeline_bubble_and_unbalanced_stages_are_reported():
    """1F1B's bubble (pp-1)/(m+pp-1), m = micro-batches per step per DP rank, and one warning line
    per stage more than 20% above the mean of the stages, in parameters or in memory."""
    from multimodal.dry_run import above_mean, bubble_fraction

    assert bubble_fraction(1, 8) == 0 and bubble_fraction(4, 32) == pytest.approx(3 / 35)
    assert [s for s, _ in above_mean([1.0, 1.0, 1.0, 1.3])] == [3]  # 21% above the mean of 1.075
    assert above_mean([1.0, 1.2]) == []  # 9% above the mean of 1.1

    lay, lines = _run_397b(*EVEN_1F1B)
    m = lay.num_microbatches
    assert lay.pp == 4 and sum(f"bubble (pp-1)/(m+pp-1) = {3 / (m + 3):.1%}" in line for line in lines) == 1
    # stage 0 holds the vision tower and the embedding and keeps pp micro-batches in flight, and its
    # every CP rank encodes all images; the other stages sit at or below the mean
    warnings = [line for line in lines if "warning:" in line]
    assert [w.split()[1:4] for w in warnings] == [["stage", "0", "holds"], ["stage", "0", "needs"],
                                                   ["stage", "0", "computes"]], warnings
    lay2, lines = _run_397b(*EVEN_1F1B, "train.global_batch_size=512")  # twice the micro-batches: a smaller bubble
    assert lay2.num_microbatches == 2 * m
    assert any(f"bubble (pp-1)/(m+pp-1) = {3 / (2 * m + 3):.1%}" in line for line in lines)
    _, lines = _run_397b(*EVEN_1F1B, "parallel.pp=1", "parallel.world_size=128")
    assert "  pipeline: pp=1, no bubble" in lines and not any("warning:" in line for line in lines)


# the 397B recipe without its virtual stages and uneven ends: plain 1F1B, layers split evenly
EVEN_1F1B = ("parallel.vpp=1", "parallel.first_stage_layers=null", "parallel.last_stage_layers=null")


def _run_397b(*over):
    from multimodal.dry_run import dry_run

    cfg = load_config("configs/qwen35_vl_397b_a17b.yaml", list(over))
    lines: list[str] = []
    assert dry_run(cfg, gpu_mem_gib=1000, out=lines.append) == 0  # fitting is not the point here
    return check_layout(cfg, cfg.parallel.world_size)[0], lines


def test_interleaved_pipeline_of_the_397b_recipe_is_balanced():
    """The recipe's vpp=5 with 5 / 20 / 20 / 15 layers per rank: the interleaved bubble
    (pp-1)/(vpp m+pp-1), each rank's layers the sum of its chunks' (one range per virtual stage), no
    stage 20% above the mean in parameters, memory or matmul FLOPs; the same ranks hold more
    activations in flight than under plain 1F1B (interleaving's cost), and per-rank parameters are
    the sum of the ranks' chunks whatever the split."""
    from multimodal.dry_run import bubble_fraction, chunk_params, rank_params, stage_memory

    assert bubble_fraction(4, 32, 5) == pytest.approx(3 / 163)
    lay, lines = _run_397b()
    m = lay.num_microbatches
    assert lay.vpp == 5 and any(f"bubble (pp-1)/(vpp*m+pp-1) = {3 / (5 * m + 3):.1%}" in line for line in lines)
    assert [sum(len(c) for c in rank) for rank in lay.chunks] == [5, 20, 20, 15]
    assert not [line for line in lines if "warning:" in line], lines
    cfg = load_config("configs/qwen35_vl_397b_a17b.yaml")
    stages = [rank_params(cfg.model, lay, s) for s in range(4)]
    assert sum(s.total for s in stages) == sum(load_dry_run_stage(cfg, s).total for s in range(4))
    assert stages[0].parts["vision"] > 0 and stages[0].parts["embedding"] > 0 and stages[3].parts["output"] > 0
    assert [sum(c.total for c in chunk_params(cfg.model, lay, s)) for s in range(4)] == [s.total for s in stages]
    # interleaving keeps more micro-batches of a rank's layers in flight: rank 1 under vpp=5 vs vpp=1
    even, _ = _run_397b("parallel.vpp=1")  # the same uneven ends, plain 1F1B
    assert stage_memory(cfg, lay, stages[1]).activations > stage_memory(cfg, even, rank_params(cfg.model, even, 1)).activations


def load_dry_run_stage(cfg, stage):
    """The family's own count of an even 4-stage split (what every layer split must add up to)."""
    from multimodal.dry_run import stage_params

    return stage_params(cfg.model, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, stage)


# ---------------------------------------------------------------- the CLI on the big recipes


@pytest.mark.parametrize("path", BIG)
def test_big_recipe_dry_run_passes(path):
    proc = _cli("--config", path, "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "stages" in out and "OK: layout valid" in out
    world = load_config(path).parallel.world_size
    assert f"world size {world}" in out


def test_dry_run_of_the_second_family_counts_its_own_layers():
    """tiny_dense_vl's dry run: its counts, its one layer kind, no MoE line; its own rules refuse."""
    proc = _cli("--config", TINY, "--dry-run", "parallel.tp=2", "parallel.pp=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tiny_dense_vl, world size 4" in proc.stdout and "OK: layout valid" in proc.stdout
    m = load_config(TINY).model
    assert f"total {model_params(m)[0] / 1e6:.1f}M" in proc.stdout
    assert re.search(r"^  1\s+1a\s", proc.stdout, re.M)  # stage 1: one attention layer
    assert "active per token" not in proc.stdout
    proc = _cli("--config", TINY, "--dry-run", "model.num_experts=4")
    assert proc.returncode == 2 and "tiny_dense_vl has a dense MLP only" in proc.stderr, proc.stderr


def test_dry_run_reports_a_layout_that_does_not_fit():
    proc = _cli("--config", "configs/qwen35_vl_397b_a17b.yaml", "--dry-run", "parallel.use_distributed_optimizer=false",
                "--gpu-mem-gib", "40")
    assert proc.returncode == 1 and "DOES NOT FIT" in proc.stdout


# the 397B recipe's virtual stages and uneven end stages set aside, so a pipeline size alone is checked
EVEN_STAGES = ["parallel.vpp=1", "parallel.first_stage_layers=null", "parallel.last_stage_layers=null"]


# Each refusal names the field and the numbers; validate() and the dry run's own layout checks may
# both catch a rule (whichever runs first words it), so the patterns accept either wording.
@pytest.mark.parametrize("override, pattern", [
    (["parallel.pp=8", "parallel.cp=4", *EVEN_STAGES], r"model\.num_layers \(60\) must be divisible by parallel\.pp x parallel\.vpp \(8 x 1\)"),
    (["parallel.ep=48"], r"model\.num_experts \(512\) must be divisible by parallel\.ep \(48\)"),
    (["parallel.cp=16"], r"model\.(linear_num_key_heads \(16\)|num_attention_heads \(32\)) must be divisible "
                         r"by parallel\.tp\*cp \(32\)"),
    (["model.num_attention_heads=8"], r"model\.num_attention_heads.* must be divisible by parallel\.(tp\*)?cp"),
    (["train.seq_length=8200"], r"train\.seq_length \(8200\) must be (divisible by|a multiple of) 2\*(parallel\.)?cp"),
    (["train.seq_length=8194", "parallel.cp=1"], r"train\.seq_length \(8194\).*parallel\.sequence_parallel"),
    (["train.global_batch_size=100"], r"train\.global_batch_size \(100\) must be a multiple"),
    (["parallel.world_size=500"], r"world size 500 is not divisible by parallel\.tp\*pp\*cp = 64"),
    (["parallel.ep=64", "parallel.world_size=256"],
     r"parallel\.ep \(64\) must divide data-parallel x context-parallel \(4 x 8 = 32\)"),
])
def test_bad_layouts_are_refused_with_the_field_and_fix(override, pattern):
    proc = _cli("--config", "configs/qwen35_vl_397b_a17b.yaml", "--dry-run", *override)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # one line naming the field and the fix, and no error.log: nothing ran
    assert proc.stderr.startswith("error: ") and re.search(pattern, proc.stderr), proc.stderr
    assert proc.stderr.count("\n") == 1 and "traceback" not in proc.stderr, proc.stderr


def test_check_layout_raises_config_error_and_notes_unimplemented_refusals():
    cfg = load_config("configs/qwen35_vl_397b_a17b.yaml")
    lay, _ = check_layout(cfg, cfg.parallel.world_size)
    p = cfg.parallel
    assert lay.dp * lay.tp * lay.pp * lay.cp == lay.world
    assert lay.edp * lay.pp * lay.etp * lay.ep == lay.world
    with pytest.raises(ConfigError, match="parallel.pp"):
        check_layout(load_config("configs/qwen35_vl_397b_a17b.yaml", ["parallel.pp=8", "parallel.cp=4", *EVEN_STAGES]),
                     p.world_size)


def test_world_size_flag_overrides_the_recipe():
    proc = _cli("--config", "configs/qwen35_vl_9b.yaml", "--dry-run", "--world-size", "16")
    assert proc.returncode == 0, proc.stderr
    assert "world size 16" in proc.stdout


# ---------------------------------------------------------------- launchers


SBATCH = sorted((ROOT / "scripts" / "slurm").glob("*.sbatch"))


def test_launchers_parse_and_reference_existing_configs():
    assert {p.name for p in SBATCH} >= {"train.sbatch", "proxy.sbatch", "qwen35_vl_9b.sbatch",
                                        "qwen35_vl_397b_a17b.sbatch"}
    for script in [*SBATCH, ROOT / "scripts" / "launch_local.sh"]:
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, (script, proc.stderr)
    for script in SBATCH:
        if script.name == "train.sbatch":
            continue
        text = script.read_text()
        configs = re.findall(r"configs/[\w.]+\.yaml", text)
        assert configs, script
        for c in configs:
            assert (ROOT / c).is_file(), (script, c)
        nodes = int(next(line.split("=")[1] for line in text.splitlines() if line.startswith("#SBATCH --nodes=")))
        recipe = yaml.safe_load((ROOT / configs[0]).read_text())
        world = (recipe.get("parallel") or {}).get("world_size")
        if world:  # the wrapper asks Slurm for exactly the GPUs the recipe is laid out for
            assert nodes * 8 == world, (script, nodes, world)


def test_sbatch_checks_the_allocation_with_a_dry_run(tmp_path):
    """train.sbatch under a simulated Slurm environment (DRY_RUN=only stops before srun): the dry
    run sees the allocation's world size, and a wrong node count is refused before any launch."""
    env = {**_env(), "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "t",
           "DRY_RUN": "only", "RUN_ROOT": str(tmp_path), "PYTHON": sys.executable}
    script = "scripts/slurm/qwen35_vl_397b_a17b.sbatch"
    ok = subprocess.run(["bash", script, "train.iters=5"], cwd=ROOT, capture_output=True, text=True,
                        env={**env, "SLURM_JOB_NUM_NODES": "64"}, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "world size 512" in ok.stdout and "OK: layout valid" in ok.stdout
    assert "world size 512" in (tmp_path / "t-42" / "logs" / "dry_run.txt").read_text()
    bad = subprocess.run(["bash", script], cwd=ROOT, capture_output=True, text=True,
                         env={**env, "SLURM_JOB_NUM_NODES": "3"}, timeout=120)
    assert bad.returncode == 2 and "world size 24 is not divisible" in bad.stderr, bad.stderr


def test_sbatch_starts_one_torchrun_per_node(tmp_path):
    """train.sbatch with stand-ins for scontrol, srun and python: the per-node command is torchrun
    with the node's rank, the first node as rendezvous, the recipe, the overrides (spaces intact)
    and the job's own log / checkpoint dirs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'gpu-a\\ngpu-b\\n'\n")
    # srun: drop its own options, run the command as node 1
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nSLURM_NODEID=1 exec "$@"\n')
    (bin_dir / "python").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/argv\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"),
           "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_ID": "9", "SLURM_JOB_NAME": "j", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NODELIST": "gpu-[a-b]", "DRY_RUN": "0", "RUN_ROOT": str(tmp_path / "runs")}
    proc = subprocess.run(["bash", "scripts/slurm/qwen35_vl_35b_a3b.sbatch", "train.iters=5", "data.cord_v2.prompt=a b"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    argv = (tmp_path / "argv").read_text().splitlines()
    run_dir = tmp_path / "runs" / "j-9"
    assert argv[:2] == ["-m", "torch.distributed.run"]
    for arg in ["--nnodes=2", "--node-rank=1", "--nproc-per-node=8", "--master-addr=gpu-a", "--master-port=29500",
                "pretrain_multimodal.py", "configs/qwen35_vl_35b_a3b.yaml", "train.iters=5", "data.cord_v2.prompt=a b",
                f"logging.dir={run_dir}", f"checkpoint.dir={run_dir}/checkpoints"]:
        assert arg in argv, (arg, argv)
    assert (run_dir / "logs").is_dir()


def test_local_launcher_runs_torchrun():
    env = {**_env(), "NPROC": "1", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "scripts/launch_local.sh", "configs/qwen35_vl_proxy.yaml", "--dry-run"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: layout valid" in proc.stdout


if __name__ == "__main__":
    _worker(sys.argv[1])
