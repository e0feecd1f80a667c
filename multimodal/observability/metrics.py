"""Where metrics go: console (with a progress bar), metrics.jsonl, TensorBoard, W&B. Rank 0 only.

metrics.jsonl holds each logged step once, across kills and resumes: a run starting at step S
(0 when fresh) first drops the rows past S (they were logged after the checkpoint it resumes
from and will be logged again), and TensorBoard purges its events past S likewise. The trainer
writes every logged step up to a checkpoint before that checkpoint exists.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

JSONL_KEYS = ("step", "loss", "grad_norm", "lr", "tokens_per_s", "tflops_per_gpu", "mfu", "mem_peak_gib")


class MetricsSink:
    def __init__(self, cfg, enabled: bool, total_iters: int, start_iter: int, config_dict: dict):
        self.enabled = enabled
        self.interval = cfg.interval
        self.jsonl = self.tb = self.wandb = self.bar = None
        self.print_lines = False
        if not enabled:
            return
        out = Path(cfg.dir)
        out.mkdir(parents=True, exist_ok=True)
        if start_iter == 0:  # a fresh run: an earlier run's rows are kept, in a file of their own
            keep_earlier_run(out / "metrics.jsonl")
        drop_rows_after(out / "metrics.jsonl", start_iter)
        self.jsonl = open(out / "metrics.jsonl", "a", buffering=1)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: events at or after it, from an earlier attempt, are hidden
            self.tb = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=start_iter + 1)
        if cfg.wandb:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("logging.wandb=true needs `pip install -e .[wandb]`") from e
            # the recipe's wandb_mode wins; unset, WANDB_MODE decides, else offline
            mode = cfg.wandb_mode or os.environ.get("WANDB_MODE") or "offline"
            self.wandb = wandb.init(project=cfg.wandb_project, dir=str(out), config=config_dict, mode=mode)
        # a bar redraws with carriage returns: only on a terminal, never into a captured log file
        self.print_lines = cfg.progress_bar and not sys.stderr.isatty()
        if cfg.progress_bar and not self.print_lines:
            from tqdm import tqdm

            self.bar = tqdm(total=total_iters, initial=start_iter, unit="step", dynamic_ncols=True, leave=True)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {k: _clean(metrics.get(k)) for k in JSONL_KEYS}
        row.update({k: _clean(v) for k, v in metrics.items() if k not in row})
        self.jsonl.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if v is not None}, step=step)
        line = console_line(step, metrics)
        if self.bar is not None:
            self.bar.write(line)
        elif self.print_lines:  # where the bar would have written it: stdout
            print(line, flush=True)
        else:
            log.info(line)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        for h in (self.bar, self.tb):
            if h is not None:
                h.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()


def keep_earlier_run(path: Path) -> Path | None:
    """Move a non-empty ``metrics.jsonl`` of an earlier run to ``metrics.<n>.jsonl`` (the next free
    n), said in one line, so a fresh run in the same logging.dir starts its own file."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    n = 1
    while (kept := path.with_name(f"metrics.{n}.jsonl")).exists():
        n += 1
    os.replace(path, kept)
    log.info("logging.dir already held a metrics.jsonl of an earlier run (this run starts at step 0): kept as %s; "
             "this run writes %s", kept, path)
    return kept


def drop_rows_after(path: Path, step: int) -> int:
    """Rewrite ``path`` without rows whose step is past ``step`` (atomically); returns how many went.
    A torn last line (a kill mid-write) goes too."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, path)
        log.info("metrics.jsonl: dropped %d row(s) past step %d (they are logged again by this run)", dropped, step)
    return dropped


def console_line(step: int, m: dict) -> str:
    """The progress line; any value may be missing, None, NaN or inf (a diverged step), never an error."""
    line = (
        f"step {step:6d} | loss {_num(m.get('loss'), '.4f')} | grad_norm {_num(m.get('grad_norm'), '.3f')} | "
        f"lr {_num(m.get('lr'), '.2e')} | {_num(m.get('tokens_per_s'), '.0f')} tok/s | "
        f"{_num(m.get('tflops_per_gpu'), '.3g')} TFLOP/s/GPU | mfu {_fmt(m.get('mfu'))} | "
        f"peak mem {_num(m.get('mem_peak_gib'), '.2f')} GiB"
    )
    if m.get("mtp_loss") is not None:  # model.mtp_num_layers
        line += f" | mtp_loss {_num(m['mtp_loss'], '.4f')}"
    if "val_loss" in m:  # a step that evaluated (multimodal/evaluation.py)
        line += f" | val_loss {_num(m.get('val_loss'), '.4f')} ({m.get('val_tokens', '?')} tokens)"
    if m.get("skipped_steps"):
        line += f" | skipped {m['skipped_steps']} (non-finite; {m.get('skipped_total', '?')} in all)"
    return line


def _num(v, spec: str) -> str:
    if v is None:
        return "n/a"
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def _clean(v):
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None if math.isnan(v) else v
    return v


def _fmt(v) -> str:
    return "n/a" if v is None or not isinstance(v, (int, float)) else f"{100 * v:.1f}%"
