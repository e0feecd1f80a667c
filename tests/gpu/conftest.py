"""GPU checks: kernels and fast paths against their references on a CUDA device.

    pytest -m gpu tests/gpu                                # every check (skipped without a GPU)
    GPU_CHECKS_JSON=results/ pytest -m gpu tests/gpu       # also keep results/<check>.json
    python tests/gpu/test_layer_graphs_gpu.py --json OUT   # one check with its own options

Each test runs its check file as its own process, with the defaults its usage line documents:
every check gets a fresh CUDA context and process group, and the class-level backend switches
some of them make (attention, GDN kernels) cannot leak into the next one.

Before the first check the session points every check's kernel caches at the training default
(``train.kernel_cache``, core/kernel_cache.py) and compiles the 2B recipe's kernels there with
``python -m multimodal.warm_kernels`` (TileLang jobs in parallel): the GDN checks use those shapes,
so a cold machine compiles them once, in parallel, instead of one by one inside each check.
``GPU_CHECKS_WARM=0`` skips the warm-up.

The checks then run side by side, ``GPU_CHECKS_JOBS`` at a time (default 3), every selected check
started as soon as a slot is free and each test waiting for its own: most of a cold suite is
kernel compilation on the CPU, which one check at a time leaves mostly idle, and the checks judge
correctness only (their timings are reported, never asserted), so sharing the GPU changes no
verdict. ``GPU_CHECKS_JOBS=1`` runs them one after another, to time a check alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _child(args: list[str]) -> subprocess.CompletedProcess:
    """``python ARGS`` from the repository root, with the repository on PYTHONPATH."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=dict(os.environ, PYTHONPATH=path),
                          capture_output=True, text=True)


@pytest.fixture(scope="session")
def warm_kernel_cache():
    """The kernel-cache variables for every check's process, and the 2B recipe's kernels in it."""
    from core.kernel_cache import use_kernel_cache
    from multimodal.config import TrainConfig

    use_kernel_cache(TrainConfig().kernel_cache)  # sets the variables in os.environ, which the checks inherit
    if os.environ.get("GPU_CHECKS_WARM", "1") != "0":
        proc = _child(["-m", "multimodal.warm_kernels", "--config", "configs/qwen35_vl_2b.yaml"])
        if proc.returncode != 0:  # the checks still compile what they need, one by one
            warnings.warn(f"warm_kernels exited {proc.returncode}: {proc.stderr.strip()[-2000:]}", stacklevel=1)


def _selected_checks(session) -> list[str]:
    """The check files of the tests this session runs (those that take ``run_check``), in test order."""
    scripts = [str(Path(item.path).resolve()) for item in session.items if "run_check" in getattr(item, "fixturenames", ())]
    return list(dict.fromkeys(scripts))


@pytest.fixture(scope="session")
def started_checks(request, tmp_path_factory, warm_kernel_cache):
    """Every selected check started on a pool of ``GPU_CHECKS_JOBS`` slots: {script: Future of its
    finished process}. Its JSON goes to ``$GPU_CHECKS_JSON/<file stem>.json`` when that is set,
    else to a temporary dir."""
    out = Path(os.environ.get("GPU_CHECKS_JSON") or tmp_path_factory.mktemp("gpu_checks"))
    out.mkdir(parents=True, exist_ok=True)
    pool = ThreadPoolExecutor(max(1, int(os.environ.get("GPU_CHECKS_JOBS", "3"))))
    futures: dict[str, Future] = {
        script: pool.submit(_child, [script, "--json", str(out / f"{Path(script).stem}.json")])
        for script in _selected_checks(request.session)}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def run_check(started_checks):
    """``run_check(__file__)``: wait for that check's process; fail with the end of its output if it
    exited non-zero."""

    def run(script: str) -> None:
        name = Path(script).stem
        proc = started_checks[str(Path(script).resolve())].result()
        assert proc.returncode == 0, (f"{name} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                                      f"--- stderr\n{proc.stderr[-6000:]}")

    return run
