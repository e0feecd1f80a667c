"""The faults a run reports in one line instead of a traceback.

Every ``TrainingError`` is something the person running the job has to act on (a recipe field,
a file, the disk, a learning rate that diverges): the entry point prints ``error: <message>``
on one line and exits with ``exit_code``; the traceback goes to ``<logging.dir>/error.log``
(and to the console with ``--verbose``). Anything else is a bug or an infrastructure failure and
keeps Python's traceback and exit code 1, so schedulers can tell the two apart: retrying a run
that ended with 2 does not help until something is changed.

This module imports nothing of the project (it is part of ``core/``), so every layer (models/,
data/, the config, the trainer) can raise these.
"""

from __future__ import annotations

USER_FIXABLE = 2  # exit code: the message says what to change before running again


class TrainingError(Exception):
    """A fault explained in one line (the message names the file, field or step and the fix)."""

    exit_code = USER_FIXABLE
    label = "error"  # the console line's first word


class ConfigError(TrainingError, ValueError):
    """A recipe problem; the message names the field and the fix."""


class CheckpointError(TrainingError):
    """A checkpoint that cannot be loaded or written: missing, truncated, another model's shapes."""


class IncompleteCheckpoint(CheckpointError, FileNotFoundError):
    """checkpoint.load names something that is not a complete checkpoint (or nothing at all)."""


class DiskFullError(CheckpointError):
    """No space left while writing a checkpoint; the partial files are removed."""


class DataError(TrainingError, RuntimeError):
    """Data files the run cannot read at all (wrong columns, too many unusable rows)."""


class NonFiniteError(TrainingError):
    """The loss or the gradient norm stayed non-finite (``train.on_nonfinite``)."""


class Stopped(TrainingError):
    """SIGINT or SIGTERM: the run stopped between steps; the message says where and how to go on.
    Exit code 128 + the signal's number, as a shell reports a process the signal ended."""

    label = "stopped"

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def one_line(text: str) -> str:
    """Collapse whitespace so a message from deep inside a library stays on one console line."""
    return " ".join(str(text).split())


def require(ok: bool, msg: str) -> None:
    """Raise ``ConfigError(msg)`` unless ``ok``: one recipe rule, its message naming field and fix."""
    if not ok:
        raise ConfigError(msg)
