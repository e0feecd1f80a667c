"""Asynchronous checkpoint saves (checkpoint.async_save): training goes on while a save is
written; `latest` moves only once it is complete, so a kill -9 during the write leaves the
previous checkpoint as `latest`, loadable; the final save is waited for."""

from __future__ import annotations

import pytest

from helpers.fault_helpers import run_cli
from multimodal.checkpoint_checks import manifest_problem

pytestmark = pytest.mark.slow


def _slow_writer(slow_if: str, sleep_s: int) -> str:
    """A prelude's first half: the writer process sleeps ``sleep_s`` seconds (once per writer, not
    once per tensor) on the first item it writes whose file name ``name`` makes ``slow_if`` true."""
    return f"""
import functools, os, signal, sys, time
from pathlib import Path
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
real = fa._write_item
@functools.wraps(real)
def slow(*args, **kwargs):
    stream = next(a for a in args if hasattr(a, "write"))
    name = str(getattr(stream, "name", ""))
    if ({slow_if}) and not getattr(slow, "slept", False):
        slow.slept = True
        time.sleep({sleep_s})
    return real(*args, **kwargs)
fa._write_item = slow
import multimodal.training as tr
real_add = tr._Window.add
"""


def _slow_write_then(sig: str, at_step: int, sleep_s: int) -> str:
    """A prelude: the writer process of the save at step 4 sleeps ``sleep_s`` seconds, and the run
    sends itself ``sig`` in step ``at_step``."""
    return _slow_writer('"iter_0000004" in name', sleep_s) + f"""
def add(self, batches, model_cfg):
    add.steps = getattr(add, "steps", 0) + 1
    if add.steps == {at_step}:
        os.kill(os.getpid(), signal.{sig})
    return real_add(self, batches, model_cfg)
tr._Window.add = add
"""


# every save after the first writes for 10 minutes; the run kills itself (SIGKILL) at the first step
# that finds one of them begun (its .tmp folder). Not a fixed step: how long the first write takes
# (and so when the deferred second save starts) depends on the machine.
SLOW_SECOND_SAVE_THEN_KILL = _slow_writer('"iter_0000002" not in name', 600) + """
def add(self, batches, model_cfg):
    ck = Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("checkpoint.dir=")))
    if any(p.name != "iter_0000002.tmp" for p in ck.glob("iter_*.tmp")):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_add(self, batches, model_cfg)
tr._Window.add = add
"""
# the save at step 4 takes a few seconds in its writer process; SIGTERM arrives in step 5
SLOW_WRITE_THEN_SIGTERM = _slow_write_then("SIGTERM", 5, 5)


def test_async_saves_complete_and_resume(tmp_path):
    ck = tmp_path / "ck"
    run = run_cli(tmp_path, "train.iters=4", "checkpoint.interval=2", f"checkpoint.dir={ck}",
                  "checkpoint.async_save=true")
    assert run.rc == 0, run.stderr[-3000:]
    assert (ck / "latest").read_text() == "iter_0000004"  # the final save was waited for
    assert sorted(p.name for p in ck.glob("iter_*")) == ["iter_0000002", "iter_0000004"]
    assert all(manifest_problem(ck / n) is None for n in ("iter_0000002", "iter_0000004"))
    resumed = run_cli(tmp_path / "b", "train.iters=5", f"checkpoint.load={ck}", "checkpoint.dir=null")
    assert resumed.rc == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in resumed.rows()] == [5]


def test_kill_during_an_async_save_keeps_the_previous_latest(tmp_path):
    ck = tmp_path / "ck"
    run = run_cli(tmp_path, "train.iters=40", "checkpoint.interval=2", f"checkpoint.dir={ck}",
                  "checkpoint.async_save=true", prelude=SLOW_SECOND_SAVE_THEN_KILL)
    assert run.rc == -9, run.stderr[-3000:]
    assert (ck / "latest").read_text() == "iter_0000002"
    assert [p.name for p in ck.glob("iter_*") if not p.name.endswith(".tmp")] == ["iter_0000002"]
    assert len(list(ck.glob("iter_*.tmp"))) == 1  # the second save's: only its .tmp, never loaded
    assert manifest_problem(ck / "iter_0000002") is None
    resumed = run_cli(tmp_path / "b", "train.iters=3", f"checkpoint.dir={ck}", "checkpoint.load=latest",
                      "checkpoint.async_save=true")
    assert resumed.rc == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in resumed.rows()] == [3]




def test_sigterm_waits_for_the_save_in_flight(tmp_path):
    ck = tmp_path / "ck"
    run = run_cli(tmp_path, "train.iters=8", "checkpoint.interval=2", f"checkpoint.dir={ck}",
                  "checkpoint.async_save=true", prelude=SLOW_WRITE_THEN_SIGTERM)
    assert run.rc == 143, run.stderr[-3000:]
    # the save due at step 4 was made then, or (deferred while the one of step 2 was still being
    # written on a busy machine) when the signal came, after step 5: never lost
    latest = (ck / "latest").read_text()
    assert latest in ("iter_0000004", "iter_0000005") and manifest_problem(ck / latest) is None
    assert run.last_line.startswith(f"stopped: SIGTERM after step 5; last checkpoint {ck}/{latest}; resume: the "
                                    f"same command with checkpoint.load=latest checkpoint.dir={ck}"), run.last_line


def test_staging_buffers_are_reused_from_one_save_to_the_next():
    """PinnedStaging (page-locked on a GPU; here it copies CPU tensors, copy_host_tensors): each
    tensor lands in a buffer of its own, equal to it and not aliasing it; the next save with the
    same layout reuses those buffers; a changed layout lets the old ones go."""
    import torch

    from multimodal.async_saves import PinnedStaging

    staging = PinnedStaging(copy_host_tensors=True)

    def buckets(*tensors):
        return [("/ckpt/__0_0.distcp", "__0_0.distcp", ([("meta", b"x")], [(f"item{i}", t) for i, t in
                                                                           enumerate(tensors)]))]

    a, b = torch.randn(4, 3), torch.arange(5, dtype=torch.int64)
    first = staging(buckets(a, b))
    staged = [t for _, t in first[0][2][1]]
    assert first[0][2][0] == [("meta", b"x")] and [i for i, _ in first[0][2][1]] == ["item0", "item1"]
    assert torch.equal(staged[0], a) and torch.equal(staged[1], b)
    assert staged[0].data_ptr() != a.data_ptr() and staging.nbytes == a.numel() * 4 + b.numel() * 8
    a.add_(1)  # the next step changes the weights; the next save copies them into the same buffers
    second = [t for _, t in staging(buckets(a, b))[0][2][1]]
    assert [t.data_ptr() for t in second] == [t.data_ptr() for t in staged] and torch.equal(second[0], a)
    staging(buckets(torch.zeros(2, 2)))  # another layout: new buffer, the old ones released
    assert staging.nbytes == 16 and len(staging.buffers) == 1


def test_first_save_stages_into_the_memory_reserved_ahead():
    """reserve() locks chunks in a background thread: one per tensor larger than a chunk, shared
    ones for the rest. The first save carves its buffers out of them (values equal, each buffer
    a storage of its own bytes, so the writer serializes only them), and the next save reuses
    them; a save that comes before the pool is complete stops the thread and uses what is there."""
    import io

    import torch

    from multimodal.async_saves import PinnedStaging

    staging = PinnedStaging(copy_host_tensors=True, chunk_bytes=1024)
    small = [torch.randn(50), torch.arange(30, dtype=torch.int64), torch.randn(7, dtype=torch.bfloat16)]
    big = [torch.randn(300), torch.randn(600)]  # 1200 and 2400 bytes: more than a chunk
    sizes = [t.numel() * t.element_size() for t in [*small, *big]]
    assert staging.plan(sizes) == [2400, 1200, 1024, 1024]
    staging.reserve(sizes)
    staging._reserving.join()
    chunks = [(c.data_ptr(), c.data_ptr() + c.numel()) for c in staging.pool]

    def save(tensors):
        return [t for _, t in staging([("/c/a.distcp", "a", ([], [(f"t{i}", t) for i, t in
                                                                enumerate(tensors)]))])[0][2][1]]

    staged = save([*small, *big])
    assert all(torch.equal(s, t) for s, t in zip(staged, [*small, *big]))
    assert all(any(lo <= s.data_ptr() < hi for lo, hi in chunks) for s in staged)  # all from the pool
    assert len({s.data_ptr() for s in staged}) == 5
    for s in staged:
        assert s.untyped_storage().nbytes() == s.numel() * s.element_size()
        blob = io.BytesIO()
        torch.save(s, blob)
        assert len(blob.getvalue()) < s.numel() * s.element_size() + 2048  # not the whole chunk
    assert staging.pool == []  # what was not carved is let go
    small[0].add_(1)
    again = save([*small, *big])  # the next save: the same buffers, the new values
    assert [t.data_ptr() for t in again] == [t.data_ptr() for t in staged] and torch.equal(again[0], small[0])

    early = PinnedStaging(copy_host_tensors=True, chunk_bytes=1024)
    early.reserve([1 << 20] * (1 << 20))  # a terabyte: the save stops it
    out = early([("/c/b.distcp", "b", ([], [("x", torch.ones(10))]))])
    assert early._reserving is None and torch.equal(out[0][2][1][0][1], torch.ones(10))


def test_checkpoint_tensor_sizes_counts_weights_main_params_and_moments_once():
    """The reserve's estimate: model state plus every inner optimizer's parameters and moments
    on the device the checkpoint stages from, each tensor once."""
    import torch

    from multimodal.async_saves import checkpoint_tensor_sizes

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    wrapper = type("Chained", (), {"chained_optimizers": [type("Inner", (), {"optimizer": opt})()]})()
    # weight (48 bytes) and bias (12) once, though they are also the optimizer's params; two
    # moments each; torch keeps each parameter's step count as a one-float tensor
    assert sorted(checkpoint_tensor_sizes(model, wrapper, device_type="cpu")) == [4, 4, 12, 12, 12, 48, 48, 48]
    assert checkpoint_tensor_sizes(model, wrapper, device_type="cuda") == []  # nothing to stage from a GPU


# the save at step 2 takes a few seconds in its writer process, so the one due at step 4 finds it
# still writing
SLOW_FIRST_WRITE = _slow_writer('"iter_0000002" in name', 8)


def test_a_save_due_while_the_previous_one_writes_is_deferred_with_one_warning(tmp_path):
    ck = tmp_path / "ck"
    run = run_cli(tmp_path, "train.iters=6", "checkpoint.interval=2", f"checkpoint.dir={ck}",
                  "checkpoint.async_save=true", prelude=SLOW_FIRST_WRITE)
    assert run.rc == 0, run.stderr[-3000:]
    deferred = [x for x in run.stderr.splitlines() if "deferred: the previous save (iter_0000002) is still" in x]
    assert len(deferred) == 1 and "checkpoint due at step 4 deferred" in deferred[0], run.stderr[-3000:]
    later = [x for x in run.stderr.splitlines() if "checkpoint due at step 4: saved at step" in x]
    assert len(later) == 1 or not (ck / "iter_0000004").exists()  # at step 5, or folded into the final save
    assert (ck / "latest").read_text() == "iter_0000006" and manifest_problem(ck / "iter_0000006") is None
    rates = [x for x in run.stderr.splitlines() if "GB/s" in x and "writer threads" in x]
    assert rates, run.stderr[-3000:]  # the writer process reports each write's rate


def test_the_writer_results_queue_is_started_with_the_run_not_at_the_first_save():
    """megatron starts its writer-results Manager (a spawned process) inside the first save, which
    then paused training for seconds; AsyncSaves starts it in the background at construction."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    from multimodal.async_saves import AsyncSaves

    before, fa._results_queue = fa._results_queue, None
    saves = AsyncSaves()
    try:
        assert saves._results_queue is not None  # the thread that starts it
        saves.ready()  # what a save does first: waits for what is left of the start
        assert fa._results_queue is not None and saves._results_queue is None
        queue = fa._results_queue
        assert fa.get_write_results_queue() is queue  # megatron's save takes this one
    finally:
        saves.close()
        fa._results_queue = before or fa._results_queue
