"""Run the optimizer step behind the next step's forward (``optimizer.overlap_step``).

Why. Flat AdamW (multimodal/performance/flat_adamw_patch.py) already runs at the device's copy bandwidth
(30 bytes per parameter; docs/performance.md). It cannot get cheaper, only hidden.
The forward that follows is mostly GEMMs, and its start (the batch's host-to-device copies, the
first launches) leaves the device partly idle, so the update runs on a second stream while the
next forward runs, each layer waiting only for its own parameters.

How.
- Units: the modules whose forward pre-hooks gate parameters. Each element of a ModuleList
  (decoder layers, vision blocks: a CUDA-graph router replays a layer inside the layer's own
  call, so its hook still fires), each module passed as ``opaque`` (the vision encoder when it
  replays all its blocks as one graph), and every other module holding parameters directly.
- Order: the first forward (step 1, before any update) records the order in which the units run.
  At the first step the parameters are cut into ``pieces`` parts in that order (about equal
  element counts, at unit boundaries); parameters of units that never ran go to the first part.
- Step: the update stream waits for the compute stream (gradients final, clip factor computed),
  then runs the flat AdamW kernel part by part, recording an event after each. The kernel writes
  zeros over the gradients it read.
- Forward: a unit's pre-hook makes the compute stream wait for the event of the last part that
  holds its parameters. The model's own pre-hook waits for part 0, its post-hook for every part,
  so the backward (which accumulates into the gradients) never starts before the update is done.
- Zeroing: megatron's ``zero_grad_buffer`` would zero the gradient buffers on the compute stream
  while the update may still read them. Right after a step whose kernel zeroed a buffer, that
  buffer's ``reset`` skips the zeroing; at any other time it zeroes as before.
- Anything else that reads the parameters or the optimizer state calls ``finish()`` first
  (checkpoint save, the end of training); the log step's parameter norm is queued behind the
  update on its stream (``behind_update``), so log steps keep the overlap.
The update is the same arithmetic on the same values as without the overlap (bit for bit); only
where it runs changes. On the CPU (no streams) the parts run in order; the tests use that.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext

import torch

log = logging.getLogger(__name__)


def instances(optimizer) -> list:
    """The flat AdamW objects under a (maybe chained) megatron optimizer."""
    flats = []
    for mopt in getattr(optimizer, "chained_optimizers", [optimizer]):
        flat = getattr(getattr(mopt, "optimizer", None), "flat_adamw", None)
        if flat is not None:
            flats.append(flat)
    return flats


def units(model: torch.nn.Module, opaque=()) -> list[tuple[torch.nn.Module, list[torch.nn.Parameter]]]:
    """(module, the parameters its pre-hook gates) in module order; see the module docstring."""
    opaque_ids = {id(m) for m in opaque}
    found = []

    def whole(module):
        params = [p for p in module.parameters() if p.requires_grad]
        if params:
            found.append((module, params))

    def walk(module):
        direct = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if direct:  # its pre-hook fires before any child runs
            found.append((module, direct))
        for child in module.children():
            if id(child) in opaque_ids:
                whole(child)
            elif isinstance(child, torch.nn.ModuleList):  # layers, blocks: one unit each
                for element in child:
                    whole(element)
            else:
                walk(child)

    if id(model) in opaque_ids:
        whole(model)
    else:
        walk(model)
    return found


def _why_not(flats) -> str | None:
    if not flats:
        return "it needs flat AdamW (optimizer.flat), which is not installed"
    if any(f.sharded for f in flats):
        return "the distributed optimizer all-gathers the parameters right after the step"
    covered: dict[int, set] = {}
    buffers = {}
    for f in flats:
        for p in f.params:
            covered.setdefault(id(p.buffer), set()).add(p.model)
            buffers[id(p.buffer)] = p.buffer
    for key, buf in buffers.items():
        if set(buf.param_index_map) != covered[key]:
            return "a gradient buffer holds parameters that flat AdamW does not update (its zeroing would be skipped)"
    return None


class UpdateOverlap:
    """See the module docstring. ``stream``: the update's CUDA stream, or None (CPU: in order)."""

    def __init__(self, model: torch.nn.Module, flats: list, stream, pieces: int = 16, opaque=()):
        self.flats = flats
        self.stream = stream
        self.pieces = max(1, pieces)
        self.units = units(model, opaque)
        self.order: list[int] = []               # units in the order the forwards ran them, until planned
        self.unit_piece: list[int] | None = None  # unit -> the last part holding its parameters
        self.piece_of: dict = {}                 # parameter -> its part
        self.work: dict[int, list] = {}          # id(flat) -> per part [(flat buffer, group, table)]
        self.events: dict[int, list] = {}        # id(flat) -> per part, the event recorded after it
        self.waited: dict[int, int] = {}         # id(flat) -> the last part the compute stream waited for
        self.zeroed: set[int] = set()            # ids of the gradient buffers the last update zeroed
        self.handles = [unit.register_forward_pre_hook(self._unit_hook(i)) for i, (unit, _) in enumerate(self.units)]
        self.handles.append(model.register_forward_pre_hook(lambda *_: self._wait(0)))
        self.handles.append(model.register_forward_hook(lambda *_: self.finish()))
        self.resets = {}
        for flat in flats:
            flat.overlap = self
            for p in flat.params:
                buf = p.buffer
                if id(buf) not in self.resets:
                    self.resets[id(buf)] = (buf, buf.reset)
                    buf.reset = self._reset_of(buf, buf.reset)

    def _unit_hook(self, index: int):
        def hook(_module, _args):
            if self.unit_piece is None:
                self.order.append(index)
            else:
                self._wait(self.unit_piece[index])
        return hook

    def _reset_of(self, buf, original):
        def reset():
            if id(buf) in self.zeroed:  # the update's kernel zeroed it (maybe still doing so on its stream)
                self.zeroed.discard(id(buf))
                for extra in getattr(buf, "extra_main_grads", []):
                    extra.zero_()
                return
            original()
        return reset

    def _plan(self) -> None:
        """Cut the parameters into parts in the order the units ran (those that never ran first)."""
        ran = list(dict.fromkeys(self.order))
        ordered = [u for u in range(len(self.units)) if u not in set(ran)] + ran
        total = sum(p.numel() for p in {p: None for _, ps in self.units for p in ps})
        target = total / self.pieces
        piece, filled = 0, 0
        self.unit_piece = [0] * len(self.units)
        for u in ordered:
            for p in self.units[u][1]:
                if p not in self.piece_of:
                    self.piece_of[p] = piece
                    filled += p.numel()
            self.unit_piece[u] = max(self.piece_of[p] for p in self.units[u][1])
            if filled >= target * (piece + 1) and piece < self.pieces - 1:
                piece += 1
        self.order = []
        log.info("optimizer.overlap_step: the update runs in %d parts in forward order, %d units gate them",
                 max(self.piece_of.values(), default=0) + 1, len(self.units))

    def run(self, flat, grad_scale) -> None:
        """``flat``'s update (its step count already advanced), part by part, on the update stream."""
        if self.unit_piece is None:
            self._plan()
        if id(flat) not in self.work:
            parts = max(self.piece_of.values(), default=0) + 1
            self.work[id(flat)] = flat.piece_tables(self.piece_of, parts)
        context = nullcontext()
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())  # gradients and clip factor are ready
            if torch.is_tensor(grad_scale):  # computed on the compute stream; keep its memory for us
                grad_scale.record_stream(self.stream)
            context = torch.cuda.stream(self.stream)
        events = []
        with context:
            for part in self.work[id(flat)]:
                for fb, group, table in part:
                    flat.update(fb, group, table, grad_scale, zero_grad=True)
                if self.stream is not None:
                    events.append(torch.cuda.Event())
                    events[-1].record(self.stream)
        self.events[id(flat)] = events
        self.waited[id(flat)] = -1
        self.zeroed.update(flat.flat.keys())

    def _wait(self, piece: int) -> None:
        """Make the current stream wait until the update has written parts 0..piece."""
        for key, events in self.events.items():
            last = min(piece, len(events) - 1)
            if last <= self.waited[key]:
                continue
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("optimizer.overlap_step: a CUDA graph capture reads parameters the update "
                                   "may still be writing (a module outside the units ran first); set "
                                   "optimizer.overlap_step=false and report the model")
            torch.cuda.current_stream().wait_event(events[last])
            self.waited[key] = last

    def finish(self) -> None:
        """The current stream waits for the whole update (before anything else reads the parameters)."""
        self._wait(self.pieces)

    @contextmanager
    def behind_update(self, *tensors):
        """Queue the block's work on the update stream, after the update: it may read the new
        parameters without making the compute stream wait for them. ``tensors``: ones made on the
        compute stream that the block reads (their memory is kept for the update stream)."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        for t in tensors:
            if torch.is_tensor(t) and t.is_cuda:
                t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            yield

    def close(self) -> None:
        """Wait for the update, remove the hooks and give the buffers their own reset back."""
        if self.stream is not None:
            self.finish()
        for handle in self.handles:
            handle.remove()
        for buf, original in self.resets.values():
            buf.reset = original
        for flat in self.flats:
            flat.overlap = None


def overlap_update_with_forward(model: torch.nn.Module, optimizer, requested: bool | None, opaque=(), pieces: int = 16):
    """The overlap for ``model`` (the unwrapped module) and ``optimizer``'s flat AdamW, or None.
    ``requested``: True / False / None (= on where flat AdamW runs its kernel on a GPU)."""
    if requested is False:
        return None
    flats = instances(optimizer)
    why = _why_not(flats)
    on_gpu = bool(flats) and flats[0].params[0].main.is_cuda
    if why is None and requested is None and not (on_gpu and all(f.use_kernel for f in flats)):
        return None  # the default elsewhere: the step stays where it is
    if why is not None:
        (log.warning if requested or on_gpu else log.info)("optimizer.overlap_step: off (%s)", why)
        return None
    # lowest priority: the update fills what the compute stream leaves free (the graphs' compute
    # stream has high priority; the default stream shares this one's)
    stream = torch.cuda.Stream(device=flats[0].params[0].main.device, priority=0) if on_gpu else None
    overlap = UpdateOverlap(model, flats, stream, pieces=pieces, opaque=opaque)
    optimizer.update_overlap = overlap
    return overlap
