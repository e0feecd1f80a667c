"""A quiet console: the warnings our dependencies print about themselves, collapsed into one line.

A CPU start of the trainer printed ~20 lines before the first step, all of them from
dependencies describing their own fallbacks (megatron-core without Transformer Engine or Apex,
fla without Triton, torch without a CUDA runtime, deprecations inside megatron). None of them
asks the user to do anything, and they bury the lines that do. ``quiet_dependency_warnings``
holds back Python warnings raised from installed packages' files and the known log records of
those packages, counts them by package, and ``summary()`` gives one line for the end of the
run; ``--verbose`` leaves everything as it was. Warnings raised from our own code, and every
record of level ERROR or above, are never held back.
"""

from __future__ import annotations

import logging
import sys
import sysconfig
import warnings
from collections import Counter
from pathlib import Path

# loggers of dependencies whose WARNING records describe the dependency itself
DEPENDENCY_LOGGERS = ("torch.utils.cpp_extension", "megatron.core.models.gpt.gpt_model")

_held: Counter = Counter()
_installed = False


def _site_dirs() -> tuple[str, ...]:
    paths = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    paths |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    return tuple(str(Path(p).resolve()) for p in paths)


def _package_of(filename: str, sites: tuple[str, ...]) -> str | None:
    """The top-level package of a file inside an installed-packages folder, else None."""
    try:
        resolved = str(Path(filename).resolve())
    except (OSError, RuntimeError):
        return None
    for site in sites:
        if resolved.startswith(site + "/"):
            return resolved[len(site) + 1:].split("/", 1)[0]
    return None


class _HoldDependencyRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        _held[record.name.split(".", 1)[0]] += 1
        return False


def quiet_dependency_warnings(verbose: bool) -> None:
    """Hold back dependency warnings from now on (call before importing torch and megatron)."""
    global _installed
    if verbose or _installed:
        return
    _installed = True
    sites = _site_dirs()
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        package = _package_of(filename, sites)
        if package is None:
            show(message, category, filename, lineno, file, line)
        else:
            _held[package] += 1

    warnings.showwarning = showwarning
    for name in DEPENDENCY_LOGGERS:
        logging.getLogger(name).addFilter(_HoldDependencyRecords())


def summary() -> str | None:
    """One line naming how many dependency warnings were held back, or None if there were none."""
    if not _held:
        return None
    parts = ", ".join(f"{name} {n}" for name, n in _held.most_common())
    return f"{sum(_held.values())} dependency warnings held back ({parts}); --verbose shows them"
