"""End-to-end training runs of the real entry point (subprocesses, CPU, gloo).

The runs a test compares against (an uninterrupted run, the first half of an interrupted one,
the recipe's own run) go through the entry point's ``main`` one after another in one subprocess,
so torch and megatron start once for all of them; every resume is a fresh process of its own, as
after a crash. Run as a script this file is that worker:
    python tests/test_training.py SPEC.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from multimodal import checkpointing

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(tmp: Path, *overrides: str, config="configs/qwen35_vl_proxy.yaml", nproc: int = 1) -> dict[int, dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if nproc == 1:
        cmd = [sys.executable, "pretrain_multimodal.py"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={_free_port()}", "pretrain_multimodal.py"]
    cmd += ["--config", config, f"logging.dir={tmp}", "logging.progress_bar=false", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def _rows(log_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines())}


def _worker(spec: Path) -> None:
    """Each run of SPEC.json ({name: argv of pretrain_multimodal.py}) through the entry point's
    main in this process; each exit code (None: an exception escaped main) to SPEC.json.out, each
    run's console output after a line "=== run NAME" on stderr."""
    import traceback

    sys.path.insert(0, str(ROOT))
    import pretrain_multimodal

    done = {}
    for name, argv in json.loads(spec.read_text()).items():
        print(f"=== run {name}", file=sys.stderr, flush=True)
        try:
            done[name] = {"rc": pretrain_multimodal.main(argv)}
        except BaseException:  # noqa: BLE001 - recorded for the test that needs this run
            done[name] = {"rc": None}
            traceback.print_exc()
        sys.stderr.flush()
    spec.with_suffix(".out").write_text(json.dumps(done))


# the reference runs, by the test that reads them: argv after --config (each a log dir of its own)
_RESUME_COMMON = ["train.seq_length=256", "train.global_batch_size=1", "train.iters=20", "data.mock.max_image_side=64",
                  "data.mock.max_text_tokens=48", "data.loader.prefetch=2"]
_OPTIMIZERS = [["optimizer.flat=null"], ["optimizer.flat=true"], ["optimizer.flat=true", "optimizer.overlap_step=true"]]
_FLAT_COMMON = ["train.seq_length=256", "train.global_batch_size=1", "train.iters=12", "data.mock.max_image_side=64",
                "data.mock.max_text_tokens=48"]


def _reference_runs(d: Path) -> dict[str, dict[str, list[str]]]:
    proxy, dense = "configs/qwen35_vl_proxy.yaml", "tests/fixtures/tiny_dense_vl.yaml"
    resume = {}
    for i, opt in enumerate(_OPTIMIZERS):
        resume[f"full{i}"] = [proxy, *_RESUME_COMMON, *opt, f"checkpoint.dir={d / f'ck_full{i}'}",
                              "checkpoint.interval=10"]
        resume[f"first{i}"] = [proxy, *_RESUME_COMMON, *opt, "train.iters=10", "optimizer.decay_iters=20",
                               f"checkpoint.dir={d / f'ck{i}'}"]
    return {
        "test_proxy_recipe_loss_falls_and_metrics_are_complete": {"recipe": [proxy, f"checkpoint.dir={d / 'ck'}"]},
        "test_second_family_trains_through_the_same_entry_point": {"dense": [dense]},
        "test_resume_reproduces_the_uninterrupted_run": resume,
        "test_flat_adamw_checkpoint_resumes_without_it": {
            "flat_full": [proxy, *_FLAT_COMMON, "optimizer.flat=false", "checkpoint.dir=null"],
            "flat_first": [proxy, *_FLAT_COMMON, "train.iters=6", "optimizer.decay_iters=12", "optimizer.flat=true",
                           f"checkpoint.dir={d / 'ck_flat'}"]},
    }


def _train_in_one_process(d: Path, runs: dict[str, list[str]]):
    """``runs`` ({name: argv of pretrain_multimodal.py}) one after another in one worker process,
    each logging to d/name. Returns rows(name): that run's metrics by step, once it succeeded."""
    runs = {name: [*argv, f"logging.dir={d / name}", "logging.progress_bar=false"] for name, argv in runs.items()}
    spec = d / "spec.json"
    spec.write_text(json.dumps(runs))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(spec)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    done = json.loads(spec.with_suffix(".out").read_text())

    def rows(name: str) -> dict[int, dict]:
        own = proc.stderr.split(f"=== run {name}\n", 1)[-1].split("\n=== run ", 1)[0]
        assert done[name] == {"rc": 0}, (done[name], own[-4000:])
        return _rows(d / name)

    return rows


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory):
    """The reference runs of the tests selected in this module, in one worker process: (their
    folder, rows(name))."""
    d = tmp_path_factory.mktemp("reference")
    wanted = {item.originalname for item in request.session.items if item.module is request.module}
    runs = {name: ["--config", *argv] for test, group in _reference_runs(d).items() if test in wanted
            for name, argv in group.items()}
    return d, _train_in_one_process(d, runs)


def test_proxy_recipe_loss_falls_and_metrics_are_complete(reference):
    rows = reference[1]("recipe")
    assert sorted(rows) == list(range(1, 31))
    first, last = rows[1]["loss"], rows[30]["loss"]
    assert last < 0.5 * first, (first, last)
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "tflops_per_gpu", "mfu", "mem_peak_gib"):
        assert key in rows[30]
    assert rows[30]["tokens_per_s"] > 0 and rows[30]["tflops_per_gpu"] > 0
    # real tokens over processed ones: the row's padding shows, and only real tokens count
    assert 0.5 < rows[30]["real_token_fraction"] <= 1.0
    assert (reference[0] / "ck" / "latest").read_text() == "iter_0000030"
    assert list((reference[0] / "recipe" / "tensorboard").iterdir())


def test_second_family_trains_through_the_same_entry_point(reference):
    """models/tiny_dense_vl (no GDN, MRoPE or MoE; one registry line) trains on the mock data: the
    answers are readable only from the pixels, so a falling loss needs its vision path too."""
    rows = reference[1]("dense")
    assert sorted(rows) == list(range(1, 21))
    first, last = rows[1]["loss"], rows[20]["loss"]
    assert last < 0.5 * first, (first, last)
    assert rows[20]["tflops_per_gpu"] > 0  # its family counted the FLOPs


@pytest.mark.parametrize("optimizer", range(len(_OPTIMIZERS)),
                         ids=["torch_adamw", "flat_adamw", "flat_adamw_overlap_step"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, reference, optimizer):
    # data.loader.prefetch=2: checkpoints must record the batches consumed, not the ones built ahead.
    # optimizer.flat=true: the moments are views of flat buffers, re-bound after the load.
    # optimizer.overlap_step=true: the save waits for the update; the resumed run learns the
    # forward order again and skips no zeroing it should not (its first step zeroes as usual).
    # The uninterrupted run and the first half come from the worker; the resume is a fresh process.
    full, first = reference[1](f"full{optimizer}"), reference[1](f"first{optimizer}")
    ck = reference[0] / f"ck{optimizer}"
    resumed = _train(tmp_path, *_RESUME_COMMON, *_OPTIMIZERS[optimizer], f"checkpoint.dir={ck}", "checkpoint.load=latest")
    assert sorted(resumed) == list(range(11, 21))
    for step in range(1, 11):
        assert first[step]["loss"] == full[step]["loss"]
    for step in range(11, 21):
        assert resumed[step]["loss"] == full[step]["loss"], step
        assert resumed[step]["lr"] == full[step]["lr"], step


def test_flat_adamw_checkpoint_resumes_without_it(tmp_path, reference):
    """A checkpoint written by a run with optimizer.flat=true (its moments and main params are
    views of flat buffers) resumes in a run without it: the same format as torch's AdamW. The two
    AdamW paths differ in the last bits, so the resumed losses match to rounding, not exactly."""
    full = reference[1]("flat_full")
    reference[1]("flat_first")  # wrote the checkpoint
    resumed = _train(tmp_path, *_FLAT_COMMON, "optimizer.flat=false", f"checkpoint.dir={reference[0] / 'ck_flat'}",
                     "checkpoint.load=latest")
    assert sorted(resumed) == list(range(7, 13))
    for step in range(7, 13):
        assert resumed[step]["loss"] == pytest.approx(full[step]["loss"], rel=1e-4), step
        assert resumed[step]["lr"] == full[step]["lr"], step


def test_torchrun_data_parallel_on_cpu(tmp_path):
    rows = _train(tmp_path, "train.iters=4", "train.global_batch_size=2", "train.seq_length=256",
                  "data.mock.max_image_side=64", "data.mock.max_text_tokens=48", "checkpoint.dir=null", nproc=2)
    assert sorted(rows) == [1, 2, 3, 4]
    assert rows[4]["loss"] < rows[1]["loss"]


def test_wandb_offline_and_parameter_norm(tmp_path):
    pytest.importorskip("wandb")
    rows = _train(tmp_path, "train.iters=2", "train.seq_length=256", "data.mock.max_image_side=64",
                  "data.mock.max_text_tokens=48", "checkpoint.dir=null", "logging.wandb=true")
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert rows[2]["param_norm"] > 0


def test_incomplete_checkpoints_are_never_loaded(tmp_path):
    good = tmp_path / "iter_0000010"
    good.mkdir()
    (good / "trainer_state.json").write_text("{}")
    (tmp_path / "iter_0000020.tmp").mkdir()  # a crash mid-save leaves this behind
    (tmp_path / "latest").write_text("iter_0000010")
    assert checkpointing.resolve("latest", str(tmp_path)) == good
    assert checkpointing.resolve(str(tmp_path), None) == good
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        checkpointing.resolve(str(tmp_path / "iter_0000020.tmp"), None)
    assert checkpointing.resolve("latest", str(tmp_path / "empty")) is None


if __name__ == "__main__":  # the worker: tests/test_training.py SPEC.json
    _worker(Path(sys.argv[1]))
