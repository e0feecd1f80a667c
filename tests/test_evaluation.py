"""The validation loop (multimodal/evaluation.py): its config checks, its loss against a direct
forward of the same samples, and that it changes nothing of training (losses, weights, RNG, data
order, resume).

Run as a script it is the worker that trains the proxy several times in one process (one start-up
for all the runs) and writes what it saw as JSON:
    python tests/test_evaluation.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

from multimodal.config import ConfigError, load_config, validate

PROXY = "configs/qwen35_vl_proxy.yaml"
# a few seconds a step on 2 CPU cores; two rows per step, so a global batch is two micro-batches
TINY = ["train.seq_length=256", "train.global_batch_size=2", "data.mock.max_image_side=64", "data.mock.max_text_tokens=48",
        "logging.progress_bar=false", "logging.tensorboard=false", "logging.interval=1"]


# ---------------------------------------------------------------- config


def _conversations_file(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    return path


@pytest.mark.parametrize("overrides, needle", [
    (["train.eval_interval=-1"], "train.eval_interval must be >= 0"),
    (["train.eval_interval=5", "train.eval_iters=0"], "train.eval_iters must be >= 1"),
    (["data.valid_path=held_out.jsonl"], "data.valid_path='held_out.jsonl' is for conversations and cord_v2"),
    (["data.name=conversations", "train.eval_interval=5"], "needs data.valid_path"),
    (["data.name=conversations", "train.eval_interval=5", "data.valid_path=missing.jsonl"], "needs data.valid_path"),
    (["data.name=cord_v2", "train.eval_interval=5", "data.valid_split=''"], "data.valid_split"),
])
def test_bad_eval_settings_give_one_line_naming_the_field(tmp_path, overrides, needle):
    if any(o.startswith("data.name=conversations") for o in overrides):
        overrides = [*overrides, f"data.path={_conversations_file(tmp_path)}", "data.tokenizer=tok"]
    if "data.name=cord_v2" in overrides:  # data.path must exist (checked at start)
        overrides = [*overrides, f"data.path={tmp_path}", "data.tokenizer=tok"]
    cfg = load_config(PROXY, overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_eval_settings_that_are_fine(tmp_path):
    """Accepted, and what the evaluator then reads: mock validation draws other samples than
    training (another seed), a conversations run reads data.valid_path."""
    import torch

    from data.mock import MockDataset
    from multimodal.evaluation import valid_data_config

    validate(load_config(PROXY, ["train.eval_interval=0", "train.eval_iters=1"]))  # no validation at all
    mock = load_config(PROXY, ["train.eval_interval=10"])
    validate(mock)
    held_out, seen = (MockDataset(mock.model, d, 256) for d in (valid_data_config(mock.data), mock.data))
    assert not any(torch.equal(held_out[i]["input_ids"], seen[i]["input_ids"]) for i in range(4))
    valid = _conversations_file(tmp_path)
    conv = load_config(PROXY, ["data.name=conversations", f"data.path={valid}", "data.tokenizer=tok",
                               "train.eval_interval=10", f"data.valid_path={valid}"])
    validate(conv)
    assert valid_data_config(conv.data).path == str(valid) and conv.train.eval_interval == 10


def test_cli_refuses_a_bad_eval_interval_with_exit_2():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "pretrain_multimodal.py", "--config", PROXY, "train.eval_interval=-2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: train.eval_interval must be >= 0")


def test_validation_data_is_held_out_and_of_the_same_kind():
    from multimodal.evaluation import valid_data_config

    d = load_config(PROXY).data
    assert valid_data_config(d).seed == d.seed + 1 and valid_data_config(d).name == "mock"
    cord = load_config(PROXY, ["data.name=cord_v2", "data.path=/data/cord"]).data
    assert (valid_data_config(cord).path, valid_data_config(cord).split) == ("/data/cord", "validation")
    conv = load_config(PROXY, ["data.name=conversations", "data.path=a.jsonl", "data.valid_path=b.jsonl"]).data
    assert valid_data_config(conv).path == "b.jsonl"


@pytest.mark.parametrize("pack, lookahead, dp", [(True, 0, 1), (True, 16, 1), (True, 16, 2), (False, 0, 2)])
def test_each_validation_sample_counts_once_per_pass(monkeypatch, pack, lookahead, dp):
    """A validation set of 3 samples and eval_iters asking for 8 rows a rank: the evaluator's loader
    scores each sample once (no sample repeats to fill the rows) and the rows after the set's end
    are blank (nothing supervised), on every data-parallel rank and packing mode."""
    from megatron.core import parallel_state as ps

    from multimodal import evaluation

    cfg = load_config(PROXY, [*TINY, "train.eval_interval=1", "train.eval_iters=4", "data.mock.num_samples=3",
                              f"data.pack={str(pack).lower()}", f"data.loader.pack_lookahead={lookahead}"])
    data = evaluation.valid_data_config(cfg.data)
    dataset = evaluation.build_dataset(cfg.model, data, cfg.train.seq_length)
    ev = evaluation.Evaluator.__new__(evaluation.Evaluator)
    ev.cfg, ev.dataset = cfg, dataset
    monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda: dp)
    want = sorted(len(dataset[i]["input_ids"]) for i in range(len(dataset)))
    lengths, supervised, blank = [], 0.0, 0
    for rank in range(dp):
        monkeypatch.setattr(ps, "get_data_parallel_rank", lambda rank=rank: rank)
        loader = ev._loader()
        for _ in range(cfg.train.eval_iters * cfg.train.global_batch_size // dp):
            row = next(loader)
            supervised += float(row["loss_mask"].sum())
            if sum(row["sample_lengths"]) == len(row["sample_lengths"]):  # blank: one pad token a sample
                assert float(row["loss_mask"].sum()) == 0 and row["image_grid_thw"].numel() == 0
                blank += 1
            else:
                lengths += row["sample_lengths"]
        assert loader.blank_rows > 0
    assert sorted(lengths) == want  # every sample once, none twice
    assert supervised == sum(float(dataset[i]["loss_mask"].sum()) for i in range(len(dataset)))
    assert blank > 0


# ---------------------------------------------------------------- runs


def _worker(out: Path) -> None:
    """Several proxy runs in this process; evaluation wrapped to check weights, RNG and modes
    around it and to compute the validation loss directly (lr = 0 run)."""
    import dataclasses

    import torch
    from megatron.core import tensor_parallel

    from data.loader import MicroBatchIterator, build_dataset
    from multimodal import evaluation, trainer
    from multimodal.training import train
    from helpers.proxy_fixtures import forward

    seen = {"evals": [], "direct": [], "shared": []}
    original = evaluation.Evaluator.run
    made = []  # the ForwardSteps the runs built
    build_step = trainer.forward_step

    def counted_step(*args):
        made.append(build_step(*args))
        return made[-1]

    trainer.forward_step = counted_step

    def direct_val_loss(ev) -> float:
        """sum of masked per-token losses / supervised tokens over the same samples, straight
        through the model (no megatron schedule, no ForwardStep, no sparse LM head)."""
        cfg, m = ev.cfg, ev.cfg.model
        data = dataclasses.replace(cfg.data, seed=cfg.data.seed + 1)  # the held-out mock samples
        loader = MicroBatchIterator.from_config(build_dataset(m, data, cfg.train.seq_length), m, data, cfg.train)
        model = ev.trainer.chunks[0]
        model.eval()
        total, tokens = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for _ in range(cfg.train.eval_iters * cfg.train.global_batch_size):
                from models import get_model_family
                from multimodal.forward_step import to_device

                batch = to_device(next(loader), torch.device("cpu"), torch.float32,
                                  row_extras=get_model_family(m.name).packed_row_extras)
                losses = forward(model, batch)
                total += (losses.double() * batch["loss_mask"].double()).sum()
                tokens += batch["loss_mask"].double().sum()
        model.train()
        return float(total / tokens)

    def checked_run(self, it):
        model = self.trainer.chunks[0]
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        rng = (torch.get_rng_state(), tensor_parallel.get_cuda_rng_tracker().get_states())
        counted = list(self.step.batches)
        got = original(self, it)
        # training's own ForwardStep, its rows for training's counts left as they were
        seen["shared"].append(self.step is made[-1] and self.step.batches == counted)
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "evaluation changed weights"
        assert all(mod.training for mod in model.modules()), "evaluation left a module in eval mode"
        assert torch.equal(torch.get_rng_state(), rng[0])
        assert all(torch.equal(a, b) for a, b in zip(tensor_parallel.get_cuda_rng_tracker().get_states().values(),
                                                     rng[1].values()))
        seen["evals"].append(it)
        if self.cfg.optimizer.lr == 0:
            seen["direct"].append(direct_val_loss(self))
        return got

    evaluation.Evaluator.run = checked_run

    def run(name, *overrides):
        cfg = load_config(ROOT / PROXY, [*TINY, f"logging.dir={out / name}", *overrides])
        train(cfg)
        return [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]

    ck = out / "ck"
    runs = {
        "plain": run("plain", "train.iters=4", f"checkpoint.dir={ck / 'plain'}"),
        "eval": run("eval", "train.iters=4", "train.eval_interval=2", "train.eval_iters=2",
                    f"checkpoint.dir={ck / 'eval'}"),
        # the first half with evaluation and a checkpoint, then a resume with evaluation
        "first": run("first", "train.iters=2", "optimizer.decay_iters=4", "train.eval_interval=2",
                     "train.eval_iters=2", f"checkpoint.dir={ck / 'resume'}"),
        "resumed": run("resumed", "train.iters=4", "train.eval_interval=2", "train.eval_iters=2",
                       f"checkpoint.dir={ck / 'resume'}", "checkpoint.load=latest"),
        # no learning: every evaluation sees the initial weights
        "frozen": run("frozen", "train.iters=2", "train.eval_interval=1", "train.eval_iters=2", "optimizer.lr=0",
                      "optimizer.min_lr=0", "checkpoint.dir=null"),
    }
    (out / "result.json").write_text(json.dumps({"runs": runs, "steps_made": len(made), **seen}))


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_runs")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "WANDB_MODE"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, __file__, str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, json.loads((out / "result.json").read_text())


def _by_step(rows):
    return {r["step"]: r for r in rows}


@pytest.mark.slow
def test_training_is_unchanged_by_evaluation(worker):
    out, res = worker
    plain, ev = _by_step(res["runs"]["plain"]), _by_step(res["runs"]["eval"])
    assert sorted(plain) == sorted(ev) == [1, 2, 3, 4]
    for s in plain:  # bit for bit on the CPU
        keys = ("loss", "grad_norm", "param_norm", "supervised_tokens", "real_token_fraction")
        assert [ev[s][k] for k in keys] == [plain[s][k] for k in keys], s
    assert [s for s in ev if "val_loss" in ev[s]] == [2, 4] and not any("val_loss" in r for r in plain.values())
    assert ev[4]["val_loss"] < ev[2]["val_loss"]  # it trains, and the validation loss sees it
    assert ev[2]["val_tokens"] == ev[4]["val_tokens"] > 0  # the same samples each time
    from helpers.fault_helpers import checkpoint_tensors

    a = checkpoint_tensors(out / "ck" / "plain" / "iter_0000004")
    b = checkpoint_tensors(out / "ck" / "eval" / "iter_0000004")
    assert sorted(a) == sorted(b) and all(a[k].equal(b[k]) for k in a)  # weights and optimizer state


@pytest.mark.slow
def test_evaluation_leaves_weights_modes_and_rng_alone(worker):
    # checked inside the worker around every evaluation (it fails the run otherwise)
    _, res = worker
    assert res["evals"] == [2, 4, 2, 4, 1, 2]
    assert res["steps_made"] == 5 and res["shared"] == [True] * 6  # one ForwardStep a run, evaluation's too


@pytest.mark.slow
def test_val_loss_is_the_mean_token_loss_of_the_validation_samples(worker):
    _, res = worker
    frozen = _by_step(res["runs"]["frozen"])
    vals = [frozen[s]["val_loss"] for s in (1, 2)]
    assert vals[0] == vals[1]  # no training in between: the same number
    assert res["direct"] == [pytest.approx(v, rel=1e-6, abs=0) for v in vals], (res["direct"], vals)


@pytest.mark.slow
def test_resume_with_evaluation_reproduces_the_uninterrupted_run(worker):
    _, res = worker
    full, first, resumed = (_by_step(res["runs"][k]) for k in ("eval", "first", "resumed"))
    assert sorted(resumed) == [3, 4]
    for s in (1, 2):
        assert first[s]["loss"] == full[s]["loss"]
    assert first[2]["val_loss"] == full[2]["val_loss"]
    for s in (3, 4):
        assert resumed[s]["loss"] == full[s]["loss"], s
    assert resumed[4]["val_loss"] == full[4]["val_loss"]


if __name__ == "__main__":  # the worker: tests/test_evaluation.py OUT_DIR
    _worker(Path(sys.argv[1]))


@pytest.mark.slow
def test_conversations_validation_file_end_to_end(tmp_path):
    """data.name=conversations with data.valid_path: the proxy trains on one file, scores the other,
    and the validation loss falls."""
    from data.tiny_tokenizer import build_tiny_tokenizer
    from test_conversations import _jsonl, write_synthetic_conversations

    build_tiny_tokenizer(tmp_path / "tok")
    records = write_synthetic_conversations(tmp_path, n=16)  # images under tmp_path/images
    train_file, valid_file = _jsonl(tmp_path / "train.jsonl", records[:12]), _jsonl(tmp_path / "valid.jsonl", records[12:])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "WANDB_MODE"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, "pretrain_multimodal.py", "--config", "configs/qwen35_vl_proxy_cord.yaml",
         "data.name=conversations", f"data.path={train_file}", f"data.valid_path={valid_file}",
         f"data.tokenizer={tmp_path / 'tok'}", "train.iters=6", "train.eval_interval=3", "train.eval_iters=1",
         "checkpoint.dir=null", f"logging.dir={tmp_path / 'log'}", "logging.progress_bar=false",
         "data.max_pixels=16384", "train.seq_length=512"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _by_step([json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()])
    assert [s for s in rows if "val_loss" in rows[s]] == [3, 6]
    assert rows[6]["val_loss"] < rows[3]["val_loss"], (rows[3]["val_loss"], rows[6]["val_loss"])
    assert rows[3]["val_tokens"] == rows[6]["val_tokens"] > 0
    assert "val_loss" in next(line for line in proc.stderr.splitlines() if "step      6 |" in line)
    print(proc.stderr[-3000:])
