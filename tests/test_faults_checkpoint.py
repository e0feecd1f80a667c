"""Fault injection around checkpoints: truncated files, another model's shapes, a mistyped
checkpoint.load, a full disk. Each ends with one line naming the file (or tensors) and the way
back, exit code 2, and leaves every earlier checkpoint loadable."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers.fault_helpers import TINY, run_cli
from multimodal import checkpointing
from core.errors import CheckpointError

pytestmark = pytest.mark.slow

CK_OPTS = ["train.iters=4", "checkpoint.interval=2"]


@pytest.fixture(scope="module")
def good_checkpoints(tmp_path_factory) -> Path:
    """iter_0000002 and iter_0000004 of a healthy proxy run (copy before damaging)."""
    tmp = tmp_path_factory.mktemp("good")
    run = run_cli(tmp, *CK_OPTS, f"checkpoint.dir={tmp / 'ck'}")
    assert run.rc == 0, run.stderr[-3000:]
    return tmp / "ck"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_truncated_shard_is_named_with_the_previous_checkpoint_and_that_one_resumes(tmp_path, good_checkpoints):
    ck = _copy(good_checkpoints, tmp_path / "ck")
    _truncate(ck / "iter_0000004" / "__0_0.distcp")
    run = run_cli(tmp_path / "a", *CK_OPTS, f"checkpoint.dir={ck}", "checkpoint.load=latest", "train.iters=6")
    assert run.rc == 2, run.stderr[-3000:]
    line = run.last_line
    assert line.startswith(f"error: checkpoint {ck}/iter_0000004 cannot be loaded: {ck}/iter_0000004/__0_0.distcp "
                           "is truncated"), line
    assert f"the previous complete checkpoint is iter_0000002: resume with checkpoint.load={ck}/iter_0000002" in line
    assert "Traceback" not in run.stderr
    # nothing good was lost: the named checkpoint resumes
    resumed = run_cli(tmp_path / "b", "train.iters=3", f"checkpoint.load={ck}/iter_0000002", "checkpoint.dir=null")
    assert resumed.rc == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in resumed.rows()] == [3]


@pytest.mark.parametrize("name", [".metadata", "rank_state/rank00000.pt", "trainer_state.json", "manifest.json",
                                  "model_config.json"])
def test_each_truncated_file_is_named(tmp_path, good_checkpoints, name, mcore):
    ck = _copy(good_checkpoints, tmp_path / "ck")
    _truncate(ck / "iter_0000004" / name)
    from helpers.proxy_fixtures import proxy_model

    _, model = proxy_model()
    with pytest.raises(CheckpointError) as e:
        checkpointing.check_loadable(ck / "iter_0000004", model)
    msg = str(e.value)
    assert name.split("/")[-1] in msg and "\n" not in msg, msg
    assert "previous complete checkpoint is iter_0000002" in msg, msg
    checkpointing.check_loadable(ck / "iter_0000002", model)  # the earlier one still checks out


def test_without_a_manifest_a_damaged_metadata_file_is_still_named(tmp_path, good_checkpoints, mcore):
    """Checkpoints written before manifests existed: the metadata read itself is guarded."""
    ck = _copy(good_checkpoints, tmp_path / "ck")
    (ck / "iter_0000004" / "manifest.json").unlink()
    _truncate(ck / "iter_0000004" / ".metadata")
    from helpers.proxy_fixtures import proxy_model

    _, model = proxy_model()
    with pytest.raises(CheckpointError, match=r"\.metadata does not load .*previous complete checkpoint is iter_0000002"):
        checkpointing.check_loadable(ck / "iter_0000004", model)


def test_resume_with_other_shapes_lists_at_most_ten_tensors_with_both_shapes(tmp_path, good_checkpoints):
    run = run_cli(tmp_path, *CK_OPTS, f"checkpoint.load={good_checkpoints}", "model.ffn_hidden_size=512",
                  "checkpoint.dir=null")
    assert run.rc == 2, run.stderr[-3000:]
    line = run.last_line
    assert "was written by another model (model.ffn_hidden_size 384 in the checkpoint, 512 here)" in line, line
    assert "linear_fc1.weight [768, 128] in the checkpoint, [1024, 128] here" in line, line
    assert len(line) < 2500


def test_more_layers_list_ten_and_count_the_rest(good_checkpoints, mcore):
    from helpers.proxy_fixtures import proxy_model

    _, model = proxy_model(["model.num_layers=8"])
    with pytest.raises(CheckpointError) as e:
        checkpointing.check_loadable(good_checkpoints / "iter_0000004", model, {"num_layers": 8})
    msg = str(e.value)
    assert "model.num_layers 4 in the checkpoint, 8 here" in msg
    listed = msg.split(" differ: ")[1].split("; and ")[0].split("; ")
    assert len(listed) == 10 and all("missing in the checkpoint" in x for x in listed), listed
    assert "more" in msg


def test_missing_explicit_load_path_is_refused_before_the_model_is_built(tmp_path):
    run = run_cli(tmp_path, "train.iters=1", f"checkpoint.load={tmp_path / 'nope'}", "checkpoint.dir=null")
    assert run.rc == 2
    assert run.last_line.startswith(f"error: checkpoint.load={tmp_path / 'nope'}: no such file or directory")
    assert "parameters per rank" not in run.stderr  # the model-built line never came


def test_latest_without_a_checkpoint_says_it_starts_fresh_in_one_line(tmp_path):
    run = run_cli(tmp_path, "train.iters=1", f"checkpoint.dir={tmp_path / 'typo'}", "checkpoint.load=latest")
    assert run.rc == 0, run.stderr[-3000:]
    lines = [x for x in run.stderr.splitlines() if "checkpoint.load=latest:" in x]
    assert len(lines) == 1 and "the folder does not exist" in lines[0] and "starting from step 0" in lines[0]


# the second save fails inside megatron's checkpoint writer after writing part of a file, and the
# disk then reports 1 MiB free (megatron's writer process passes on only "<class 'OSError'>")
ENOSPC_ON_SECOND_SAVE = """
import errno, functools, os, shutil
real_usage = shutil.disk_usage
def usage(path):
    u = real_usage(path)
    full = os.path.exists(os.path.join(path, "iter_0000004.tmp"))
    return type(u)(u.total, u.total - 2**20, 2**20) if full else u
shutil.disk_usage = usage
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
real = fa._write_item
calls = {"saves": set()}
@functools.wraps(real)  # megatron inspects its signature
def failing(*args, **kwargs):
    stream = next(a for a in args if hasattr(a, "write"))
    calls["saves"].add(getattr(stream, "name", ""))
    if any("iter_0000004" in str(n) for n in calls["saves"]):
        stream.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(*args, **kwargs)
fa._write_item = failing
"""


@pytest.mark.parametrize("async_save", ["false", "true"])  # true: the failure comes from megatron's writer process
def test_disk_full_names_the_path_removes_partial_files_and_keeps_earlier_checkpoints(tmp_path, mcore, async_save):
    ck = tmp_path / "ck"
    run = run_cli(tmp_path, *CK_OPTS, f"checkpoint.dir={ck}", f"checkpoint.async_save={async_save}",
                  prelude=ENOSPC_ON_SECOND_SAVE)
    assert run.rc == 2, run.stderr[-3000:]
    line = run.last_line
    assert line.startswith(f"error: no space left on device writing checkpoint iter_0000004 under {ck}"), line
    assert "MiB needed" in line and "the previous checkpoint iter_0000002 is intact" in line, line
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000002", "latest"]  # no .tmp left behind
    assert (ck / "latest").read_text() == "iter_0000002"
    from helpers.proxy_fixtures import proxy_model

    _, model = proxy_model()
    assert checkpointing.check_loadable(ck / "iter_0000002", model)["iteration"] == 2
    rows = run.rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # logged before the failed save


def test_rank_files_load_without_pickled_code(good_checkpoints):
    """weights_only=True: the RNG state is stored as plain types and tensors."""
    import torch

    state = torch.load(good_checkpoints / "iter_0000004" / "rank_state" / "rank00000.pt", weights_only=True)
    assert set(state) == {"rng", "data"} and isinstance(state["rng"]["numpy"], dict)
    assert json.loads((good_checkpoints / "iter_0000004" / "trainer_state.json").read_text())["finite"] is True


def _fake_checkpoint(root: Path, it: int, run_id: str, **state) -> Path:
    d = root / f"iter_{it:07d}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"iteration": it, "run_id": run_id, "finite": True, **state}))
    return d


def test_pruning_keeps_what_this_run_wrote_and_never_leaves_latest_dangling(tmp_path):
    """The issue's data loss: a fresh run wrote iter_0000002 into a folder holding an older run's
    iter_0000008, and keep_last=1 (sorted by name) deleted the new one and left `latest` naming it."""
    old = [_fake_checkpoint(tmp_path, it, "old") for it in (4, 8)]
    mine = [_fake_checkpoint(tmp_path, it, "new", lineage=["new"]) for it in (1, 2)]
    (tmp_path / "latest").write_text(mine[-1].name)
    checkpointing.prune(tmp_path, 1, mine[-1], ["new"])
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000002", "iter_0000004", "iter_0000008"]
    assert (tmp_path / (tmp_path / "latest").read_text()).is_dir()
    # a resumed run (lineage old -> new2) from iter_0000004: prunes its lineage up to its own step
    # (the older run's iter_0000004 goes at keep_last=1), keeps iter_0000008 (past it) and the others'
    _fake_checkpoint(tmp_path, 6, "new2")
    checkpointing.prune(tmp_path, 1, tmp_path / "iter_0000006", ["old", "new2"])
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000002", "iter_0000006", "iter_0000008"]
    # the newest checkpoint with normal losses is kept whatever keep_last says
    _fake_checkpoint(tmp_path, 7, "new2", normal=False)
    checkpointing.prune(tmp_path, 1, tmp_path / "iter_0000007", ["old", "new2"])
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000002", "iter_0000006", "iter_0000007",
                                                               "iter_0000008"]
    assert old[1].is_dir()


def test_a_fresh_run_into_an_old_checkpoint_dir_is_refused_in_one_line(tmp_path, good_checkpoints):
    ck = _copy(good_checkpoints, tmp_path / "ck")
    run = run_cli(tmp_path / "a", "train.iters=2", f"checkpoint.dir={ck}")
    assert run.rc == 2, run.stderr[-3000:]
    assert run.last_line.startswith(f"error: checkpoint.dir={ck} already holds another run's checkpoints "
                                    "(2 checkpoint(s), newest iter_0000004)"), run.last_line
    assert "checkpoint.load=latest" in run.last_line and "checkpoint.overwrite=true" in run.last_line
    assert "parameters per rank" not in run.stderr  # before the model is built
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000002", "iter_0000004", "latest"]


def test_overwrite_writes_beside_an_old_run_and_prunes_only_its_own(tmp_path, good_checkpoints):
    """checkpoint.overwrite=true, keep_last=1: the old run's iter_0000004 stays, this run's iter_0000001
    is pruned, its iter_0000002 replaces the old one of that number, and `latest` names it. The
    earlier run's metrics.jsonl in the same logging.dir is kept as metrics.1.jsonl. The same
    settings and schedule as the earlier run: a deterministic repeat, same losses bit for bit."""
    ck = _copy(good_checkpoints, tmp_path / "ck")
    old_rows = (good_checkpoints.parent / "metrics.jsonl").read_text()
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "metrics.jsonl").write_text(old_rows)
    run = run_cli(tmp_path / "log", "train.iters=2", "optimizer.decay_iters=4", "checkpoint.interval=1",
                  "checkpoint.keep_last=1", f"checkpoint.dir={ck}", "checkpoint.overwrite=true")
    assert run.rc == 0, run.stderr[-3000:]
    assert "checkpoint.overwrite=true" in run.stderr and "holds another run's checkpoints" in run.stderr
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000002", "iter_0000004", "latest"]
    assert (ck / "latest").read_text() == "iter_0000002"
    assert json.loads((ck / "iter_0000002" / "trainer_state.json").read_text())["run_id"] != \
        json.loads((ck / "iter_0000004" / "trainer_state.json").read_text())["run_id"]
    assert (tmp_path / "log" / "metrics.1.jsonl").read_text() == old_rows
    assert [r["step"] for r in run.rows()] == [1, 2]
    old = [json.loads(line) for line in old_rows.splitlines()][:2]
    assert [(r["loss"], r["grad_norm"]) for r in run.rows()] == [(r["loss"], r["grad_norm"]) for r in old]
    assert "kept as" in run.stderr and "metrics.1.jsonl" in run.stderr
    # the run's last line says where everything is
    done = next(x for x in run.stderr.splitlines() if " done: steps 1-2 in " in x)
    assert f"checkpoint: {ck}/iter_0000002" in done and "final loss" in done and "real tokens" in done


def test_resume_with_another_lr_warmup_and_length_rebuilds_the_schedule(tmp_path, good_checkpoints):
    """megatron matched the saved param groups by max_lr ("Could not find parameter group with key")
    and kept the checkpoint's warm-up and length in silence. Resumed from iter_0000002 with
    keep_last=1, the lineage is pruned up to the run's own step: iter_0000004 (past it) is kept."""
    ck = _copy(good_checkpoints, tmp_path / "ck")
    run = run_cli(tmp_path, "train.iters=3", f"checkpoint.load={ck}/iter_0000002", f"checkpoint.dir={ck}",
                  "optimizer.lr=1e-3", "optimizer.min_lr=1e-4", "optimizer.warmup_iters=4", "optimizer.decay_iters=6",
                  "checkpoint.interval=3", "checkpoint.keep_last=1")
    assert run.rc == 0, run.stderr[-3000:]
    line = next(x for x in run.stderr.splitlines() if "resuming with another LR schedule" in x)
    assert "optimizer.lr 0.003 -> 0.001" in line and "optimizer.warmup_iters 3 -> 4" in line, line
    assert "train.iters 4 -> 6" in line, line
    # linear warm-up to 1e-3 over 4 steps: after step 3, 3/4 of it (megatron's scheduler)
    assert [(r["step"], r["lr"]) for r in run.rows()] == [(3, pytest.approx(0.75e-3))]
    assert sorted(p.name for p in ck.glob("iter_*")) == ["iter_0000003", "iter_0000004"]
    assert (ck / "latest").read_text() == "iter_0000003"


def test_a_garbled_file_of_the_same_size_is_named_by_its_checksum(tmp_path, good_checkpoints, mcore):
    ck = _copy(good_checkpoints, tmp_path / "ck")
    shard = ck / "iter_0000004" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    from helpers.proxy_fixtures import proxy_model

    _, model = proxy_model()
    with pytest.raises(CheckpointError) as e:
        checkpointing.check_loadable(ck / "iter_0000004", model)
    msg = str(e.value)
    assert f"{shard} is damaged (crc32 " in msg and "previous complete checkpoint is iter_0000002" in msg, msg


def test_a_checkpoint_without_our_manifest_needs_checkpoint_trust(tmp_path, good_checkpoints, mcore):
    """torch's reader unpickles .metadata: a folder this framework did not write is refused unless trusted."""
    ck = _copy(good_checkpoints, tmp_path / "ck")
    (ck / "iter_0000004" / "manifest.json").unlink()
    from helpers.proxy_fixtures import proxy_model

    _, model = proxy_model()
    with pytest.raises(CheckpointError, match=r"has no manifest.json of this framework.*checkpoint.trust=true"):
        checkpointing.check_loadable(ck / "iter_0000004", model, trust=False)
    assert checkpointing.check_loadable(ck / "iter_0000004", model, trust=True)["iteration"] == 4
    assert checkpointing.check_loadable(ck / "iter_0000002", model, trust=False)["iteration"] == 2


def test_weights_only_checkpoints_get_a_manifest_with_checksums(tmp_path, mcore):
    """What convert_hf.py import writes (save_weights) is trusted and checked like a training checkpoint."""
    from helpers.proxy_fixtures import proxy_model

    from multimodal.checkpoint_checks import read_manifest, write_manifest

    _, model = proxy_model()
    path = checkpointing.save_weights(tmp_path / "w", model)
    files = read_manifest(path)
    assert files and all("crc32" in f for f in files.values()) and not (path / "checksums").exists()
    assert checkpointing.check_loadable(path, model, trust=False)["weights_only"] is True
    before = (path / "manifest.json").read_text()
    write_manifest(path)  # one argument, as before: the same record again
    assert (path / "manifest.json").read_text() == before


def test_an_unwritable_checkpoint_dir_is_refused_before_training(tmp_path, monkeypatch):
    import errno

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match=rf"checkpoint.dir={blocker}/ck is not writable"):
        checkpointing.check_writable(str(blocker / "ck"))

    def read_only(self, data):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "write_bytes", read_only)
    with pytest.raises(CheckpointError, match=r"is not writable \(OSError: \[Errno 30\] Read-only file system"):
        checkpointing.check_writable(str(tmp_path / "ck"))


def test_a_checkpoint_dir_without_room_for_one_checkpoint_is_refused(tmp_path, monkeypatch, mcore):
    import shutil as sh

    from helpers.proxy_fixtures import proxy_model

    _, model = proxy_model()
    need, what = checkpointing.estimate_bytes(model, 1)
    n = sum(p.numel() for p in model.parameters())
    assert need == n * 12 and "parameters per rank" in what  # fp32 weights + two fp32 moments
    real = sh.disk_usage
    monkeypatch.setattr(sh, "disk_usage", lambda p: type(real(p))(10 * 2**20, 9 * 2**20, 2**20))
    with pytest.raises(CheckpointError, match=r"has 1.0 MiB free, one checkpoint needs about 14.4 MiB"):
        checkpointing.check_free_space(str(tmp_path), need, what)


def test_cli_refuses_an_unwritable_checkpoint_dir_before_the_model_is_built(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    run = run_cli(tmp_path / "log", "train.iters=1", f"checkpoint.dir={blocker}/ck")
    assert run.rc == 2 and run.last_line.startswith(f"error: checkpoint.dir={blocker}/ck is not writable"), run.stderr
    assert "parameters per rank" not in run.stderr


INTERRUPT_IN_STEP_3 = """
import os, signal
# a foreground run's Ctrl-C: a test suite started in the background (``cmd &``) hands its children
# SIGINT ignored, as the shell does for background jobs
signal.signal(signal.SIGINT, signal.default_int_handler)
import multimodal.training as tr
real_add = tr._Window.add
def add(self, batches, model_cfg):
    add.steps = getattr(add, "steps", 0) + 1
    if add.steps == 3:
        os.kill(os.getpid(), signal.SIGINT)
    return real_add(self, batches, model_cfg)
tr._Window.add = add
"""


def test_sigint_is_one_line_with_the_step_the_checkpoint_and_the_resume_command(tmp_path):
    ck = tmp_path / "ck"
    run = run_cli(tmp_path, "train.iters=6", "checkpoint.interval=2", f"checkpoint.dir={ck}", prelude=INTERRUPT_IN_STEP_3)
    assert run.rc == 130, run.stderr[-3000:]
    assert run.last_line.startswith(f"stopped: interrupted (SIGINT) after step 2; last checkpoint {ck}/iter_0000002; "
                                    f"resume: the same command with checkpoint.load=latest checkpoint.dir={ck}"), \
        run.last_line
    assert "Traceback" not in run.stderr and "KeyboardInterrupt" not in run.stderr


assert TINY  # (the runs above are the tiny proxy; see helpers/fault_helpers.py)
