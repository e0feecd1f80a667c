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
    lines = [x for x in run.stderr.splitlines() if "checkpoint.load=latest" in x]
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


def test_disk_full_names_the_path_removes_partial_files_and_keeps_earlier_checkpoints(tmp_path, mcore):
    ck = tmp_path / "ck"
    run = run_cli(tmp_path, *CK_OPTS, f"checkpoint.dir={ck}", prelude=ENOSPC_ON_SECOND_SAVE)
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


assert TINY  # (the runs above are the tiny proxy; see helpers/fault_helpers.py)
