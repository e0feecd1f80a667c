"""GPU checks: kernels and fast paths against their references on a CUDA device.

    pytest -m gpu tests/gpu                                # every check (skipped without a GPU)
    GPU_CHECKS_JSON=results/ pytest -m gpu tests/gpu       # also keep results/<check>.json
    python tests/gpu/test_layer_graphs_gpu.py --json OUT   # one check with its own options

Each test runs its check file as its own process, with the defaults its usage line documents:
every check gets a fresh CUDA context and process group, and the class-level backend switches
some of them make (attention, GDN kernels) cannot leak into the next one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_check(tmp_path):
    """``run_check(__file__)``: run that check; fail with the end of its output if it exits non-zero.
    Its JSON goes to ``$GPU_CHECKS_JSON/<file stem>.json`` when that is set, else to a temporary dir."""

    def run(script: str) -> None:
        out = Path(os.environ.get("GPU_CHECKS_JSON") or tmp_path)
        out.mkdir(parents=True, exist_ok=True)
        name = Path(script).stem
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        proc = subprocess.run([sys.executable, script, "--json", str(out / f"{name}.json")], cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=path), capture_output=True, text=True)
        assert proc.returncode == 0, (f"{name} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                                      f"--- stderr\n{proc.stderr[-6000:]}")

    return run
