"""The non-finite guard: a step whose gradient norm is NaN or inf never changes the weights.

Why here. megatron-core (bf16/fp32, no loss scaler) steps whatever it gets: a NaN loss made NaN
weights, then NaN checkpoints. Its own skip (``grad_norm_skip_threshold``) compares on the host
every step, a device sync this trainer avoids.

How, with no host sync per step:
- megatron's ChainedOptimizer computes the global gradient norm once per step (all ranks agree
  on it: the norm is all-reduced over the model-parallel ranks of already DP-reduced gradients).
  ``get_grad_norm`` is wrapped to turn it into a device flag, 1.0 when it is not finite.
- every torch optimizer underneath gets that flag as its ``found_inf`` (AMP's convention): torch's
  fused AdamW/SGD kernels then leave parameters, moments and step counts as they were, and flat
  AdamW's kernel (multimodal/performance/flat_adamw_patch.py, with or without the overlapped update) does the same.
  Only a non-fused torch optimizer (optimizer.fused=false) cannot, so there the flag is read on
  the host before its step (one sync per step on that path, said once at start-up).
- counters stay on the device ([skipped total, skipped in a row, and step, grad norm, loss of the
  first step of the current run of skips]) and are read with the log step's other metrics
  (``review``) and before every checkpoint (``before_save``), where the run stops per
  ``train.on_nonfinite`` with one line naming the step, the numbers, the lr and the last good
  checkpoint.
- a checkpoint is written only from finite weights (``weights_finite``, one read per save).
- "last good checkpoint" is the newest one whose logged losses and grad norms were normal: each
  checkpoint keeps the (step, loss, grad norm) of its last log rows; a checkpoint is normal when
  those since the previous one are finite, no grad norm is above ``SPIKE`` times the median of
  the earlier normal ones and no loss above ``LOSS_RISE`` times theirs (a run that diverges
  slowly, under a too-short warm-up, has finite but already exploding numbers before the NaN).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from core.errors import NonFiniteError

log = logging.getLogger(__name__)

COUNTERS = 5  # skipped total, in a row, first step of the run of skips, its grad norm, its loss
SPIKE = 10.0  # a grad norm this many times the median of the normal ones so far is not normal
LOSS_RISE = 2.0  # nor a loss this many times theirs
HISTORY = 32  # log rows kept in each checkpoint's trainer state


class NonFiniteGuard:
    def __init__(self, optimizer, mode: str, max_in_row: int, device: torch.device):
        if mode not in ("skip", "stop"):
            raise ValueError(f"on_nonfinite must be skip|stop, got {mode!r}")
        self.mode, self.max_in_row = mode, max_in_row
        self.flag = torch.zeros((), dtype=torch.float32, device=device)  # this step: 1.0 = skipped
        self.norm = torch.zeros((), dtype=torch.float32, device=device)  # this step's grad norm
        self.counters = torch.zeros(COUNTERS, dtype=torch.float64, device=device)
        self.step = torch.zeros((), dtype=torch.float64, device=device)  # filled, never copied from the host
        self.read_total = 0  # skipped steps already reported
        self.lrs: dict[int, float] = {}  # lr of the steps not yet reviewed (for the message)
        self.last_good: str | None = None  # the newest checkpoint whose losses were normal (loaded or saved)
        self.history: list[list] = []  # [step, loss, grad norm] of the log rows (host values, already read)
        self.since_save = 0  # rows logged since the last checkpoint
        self.host_checked = False
        self.flats = []
        self._install(optimizer)

    # ------------------------------------------------------------------ wiring

    def _install(self, optimizer) -> None:
        if not hasattr(optimizer, "chained_optimizers"):  # megatron-core 0.19 always chains
            raise RuntimeError("the non-finite guard expects megatron's ChainedOptimizer "
                               f"(get_megatron_optimizer), got {type(optimizer).__name__}")
        compute_norm = optimizer.get_grad_norm

        def get_grad_norm():
            norm = compute_norm()
            self._observe(norm)
            return norm

        optimizer.get_grad_norm = get_grad_norm  # ChainedOptimizer.step calls it once per step
        for mopt in optimizer.chained_optimizers:
            inner = getattr(mopt, "optimizer", None)
            if inner is None or getattr(mopt, "is_stub_optimizer", False):
                continue
            flat = getattr(inner, "flat_adamw", None)
            if flat is not None:
                self.flats.append(flat)
            if flat is not None or all(g.get("fused") for g in inner.param_groups):
                inner.found_inf = self.flag  # read by the kernels, on the device
            else:
                inner.step = self._checked_on_host(inner.step)
        if self.host_checked:
            log.info("train.on_nonfinite: the optimizer is not fused (optimizer.fused=false), so the "
                     "non-finite check reads the gradient norm on the host every step")

    def _checked_on_host(self, step):
        self.host_checked = True

        def run(*args, **kwargs):
            if self.flag.item():  # the one per-step sync, on the non-fused path only
                return None
            return step(*args, **kwargs)
        return run

    def _observe(self, norm) -> None:
        value = norm.reshape(()).float() if torch.is_tensor(norm) else torch.tensor(float(norm))
        self.norm.copy_(value)  # copy_: the kernels hold these very tensors
        self.flag.copy_((~torch.isfinite(self.norm)).float())

    # ------------------------------------------------------------------ per step (device only)

    @torch.no_grad()
    def after_step(self, it: int, lr: float, step_report: torch.Tensor) -> torch.Tensor:
        """Count this step; returns ``step_report`` ([loss sum, tokens]) or zeros if it was skipped,
        so the logged loss is that of the steps that updated the weights."""
        self.lrs[it] = lr
        f = self.flag.double()
        c = self.counters
        c[0] += f
        c[1] = (c[1] + 1) * f
        loss = step_report[0].double() / step_report[1].double().clamp_min(1)
        # fill_ passes the step as a kernel argument; torch.tensor(it, device=...) would be a
        # blocking host-to-device copy, i.e. a sync every step
        self.step.fill_(float(it))
        first = torch.stack([self.step, self.norm.double(), loss])
        c[2:] = torch.where((c[1] == 1) & (f > 0), first, c[2:])
        return torch.where(self.flag > 0, torch.zeros_like(step_report), step_report)

    # ------------------------------------------------------------------ on the host

    def review(self, it: int, counters: list[float]) -> tuple[dict, NonFiniteError | None]:
        """Counters read at step ``it`` -> (metrics for the log row, the error to stop with or None)."""
        total, in_row, first, norm, loss = counters
        total, in_row, first = int(total), int(in_row), int(first)
        new = max(total - self.read_total, 0)
        self.read_total = total
        for flat in self.flats:
            flat.uncount(new)  # its kernel skipped them; its host count did not know
        lr = self.lrs.get(first, float("nan"))
        self.lrs = {k: v for k, v in self.lrs.items() if in_row and k >= first}
        metrics = {"skipped_steps": new, "skipped_total": total}
        if not new and not in_row:
            return metrics, None
        what = (f"step {first}: non-finite gradient norm ({_num(norm)}), loss {_num(loss)}, lr {lr:.3g}; "
                f"{in_row} update(s) skipped in a row, {total} in all")
        stop = (self.mode == "stop" and new) or in_row >= self.max_in_row
        if not stop:
            if new:  # once per read that found new ones
                log.warning("%s (train.on_nonfinite=skip: the weights stay those of the last finite step)", what)
            return metrics, None
        why = ("train.on_nonfinite=stop" if self.mode == "stop"
               else f"train.max_nonfinite_steps={self.max_in_row} reached")
        where = (f"last good checkpoint: {self.last_good}" if self.last_good
                 else "no checkpoint was written from finite weights yet")
        return metrics, NonFiniteError(f"{what}; stopped ({why}) at step {it}; {where}; lower optimizer.lr "
                                       "or raise optimizer.warmup_iters and resume from it")

    def record(self, it: int, loss: float, grad_norm: float) -> None:
        """A log row's loss and grad norm (read on the host with the row: no extra sync)."""
        self.history = [*self.history, [it, loss, grad_norm]][-4 * HISTORY:]
        self.since_save += 1

    def resume(self, trainer_state: dict, path: str) -> None:
        """History and last good checkpoint from the loaded checkpoint's trainer state."""
        self.history = [list(r) for r in trainer_state.get("history", [])]
        normal = trainer_state.get("normal", trainer_state.get("finite", True))
        self.last_good = path if normal else trainer_state.get("last_normal")

    def checkpoint_state(self) -> dict:
        """Trainer-state fields of the checkpoint about to be written: its history, whether it is
        normal, and the newest earlier normal one."""
        recent = self.history[len(self.history) - self.since_save:] if self.since_save else self.history[-1:]
        earlier = self.history[:len(self.history) - len(recent)]
        ok = all(math.isfinite(loss) and math.isfinite(gn) for _, loss, gn in recent)
        ref_gn = sorted(gn for _, _, gn in earlier if math.isfinite(gn))
        ref_loss = sorted(loss for _, loss, _ in earlier if math.isfinite(loss))
        if ok and len(ref_gn) >= 3:
            ok = max(gn for _, _, gn in recent) <= SPIKE * ref_gn[len(ref_gn) // 2]
        if ok and len(ref_loss) >= 3:
            ok = max(loss for _, loss, _ in recent) <= LOSS_RISE * ref_loss[len(ref_loss) // 2]
        return {"history": self.history[-HISTORY:], "normal": ok, "last_normal": self.last_good}

    def saved(self, path: str, state: dict) -> None:
        self.since_save = 0
        if state.get("normal"):
            self.last_good = path
        else:
            log.warning("checkpoint %s: loss or grad norm not normal since the previous checkpoint (%s); the last "
                        "good checkpoint stays %s", path, state["history"][-1:], self.last_good or "none")

    def before_save(self, it: int) -> None:
        """Read the counters now (a save waits for the device anyway) and stop before writing
        anything if the run should stop."""
        _, error = self.review(it, self.counters.tolist())
        if error is not None:
            raise error


def weights_finite(model) -> bool:
    """True when every parameter on every rank is finite (one device read; for saves only)."""
    params = [p.detach() for p in model.parameters()]
    device = params[0].device if params else torch.device("cpu")
    bad = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        bad += (~torch.isfinite(p)).any().float()
    if dist.is_initialized():  # every rank holds other shards; all of them save together
        dist.all_reduce(bad)
    return not bad.item()


def _num(v: float) -> str:
    return "nan" if math.isnan(v) else f"{v:.4g}"
