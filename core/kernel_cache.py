"""Where compiled GPU kernels and their autotune choices are kept between runs (``train.kernel_cache``).

Triton (our fused kernels, fla), TileLang (FlashQLA's GDN kernels) and torch's inductor each keep an
on-disk cache, by default under the home directory of whoever runs the job. Compiling them is most
of the time before a new recipe's first step. Pointing all three at one folder means:
- a second run of a recipe on the same machine finds its kernels built and its autotune choices made
  (Triton keeps autotune results only with ``TRITON_CACHE_AUTOTUNING=1``, set here);
- a folder on a shared file system serves every node of a job, and every later job, from what one
  process compiled once.
A variable the user has already set wins: it is left as it is and reported as such.
"""

from __future__ import annotations

import os
from pathlib import Path

# environment variable -> sub-folder of train.kernel_cache
CACHE_VARIABLES = {"TRITON_CACHE_DIR": "triton", "TILELANG_CACHE_DIR": "tilelang",
                   "TORCHINDUCTOR_CACHE_DIR": "inductor"}
AUTOTUNE_VARIABLE = "TRITON_CACHE_AUTOTUNING"


def use_kernel_cache(root: str | os.PathLike) -> dict[str, str]:
    """Point the kernel caches at sub-folders of ``root`` (created) unless already set; returns
    each variable's folder as it is now, for the log. The libraries read these variables when they
    compile, so this must run before the first kernel is built, not before they are imported."""
    base = Path(root).expanduser()
    chosen = {}
    for var, sub in CACHE_VARIABLES.items():
        if not os.environ.get(var):
            (base / sub).mkdir(parents=True, exist_ok=True)
            os.environ[var] = str(base / sub)
        chosen[var] = os.environ[var]
    os.environ.setdefault(AUTOTUNE_VARIABLE, "1")
    chosen[AUTOTUNE_VARIABLE] = os.environ[AUTOTUNE_VARIABLE]
    return chosen


def describe(chosen: dict[str, str], root: str | os.PathLike) -> str:
    """One log line: the cache folder, and any variable the user pointed elsewhere."""
    base = Path(root).expanduser()
    own = [v for v, sub in CACHE_VARIABLES.items() if chosen[v] != str(base / sub)]
    elsewhere = f"; kept from the environment: {', '.join(f'{v}={chosen[v]}' for v in own)}" if own else ""
    return f"kernel cache: {base} (compiled kernels and autotune choices reused across runs){elsewhere}"
