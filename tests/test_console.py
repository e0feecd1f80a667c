"""The quiet console (core/console.py, multimodal/observability/metrics.py): dependency warnings counted in one
line instead of printed, our own warnings and errors untouched, no progress-bar redraws in a
captured log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_HOLD_CHECK = """
import sysconfig, warnings
from pathlib import Path
from core import console
console.quiet_dependency_warnings(False)
site_file = str(Path(sysconfig.get_paths()["purelib"]) / "somepkg" / "mod.py")
warnings.warn_explicit("a dependency talks about itself", UserWarning, site_file, 1)
warnings.warn_explicit("another one", UserWarning, site_file, 2)
warnings.warn_explicit("ours: look at this", UserWarning, "/work/ours.py", 3)
import logging
logging.basicConfig()
logging.getLogger("torch.utils.cpp_extension").warning("no CUDA runtime")
logging.getLogger("torch.utils.cpp_extension").error("a real failure")
print(console.summary())
"""


def test_dependency_warnings_are_counted_and_ours_are_shown():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _HOLD_CHECK], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "3 dependency warnings held back (somepkg 2, torch 1); --verbose shows them"
    assert "ours: look at this" in proc.stderr and "a real failure" in proc.stderr
    assert "talks about itself" not in proc.stderr and "no CUDA runtime" not in proc.stderr


def test_a_captured_run_prints_step_lines_without_bar_redraws(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "pretrain_multimodal.py", "--config", "configs/qwen35_vl_proxy.yaml",
                           "train.iters=1", "checkpoint.dir=null", f"logging.dir={tmp_path}"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("step      1 | loss ")
    assert "\r" not in proc.stdout + proc.stderr
    assert "UserWarning" not in proc.stderr and "dependency warnings held back" in proc.stderr
    # the set-up lines (platform, transforms, kernels, model, data), step 1's start-up time and rows
    # read, the summary and the held-back count: 16 on this CPU run, and no more
    assert len(proc.stderr.splitlines()) <= 16, proc.stderr
