"""AdamW over flat buffers for megatron-core's optimizers: one kernel per parameter group that
updates the fp32 main parameters and both moments and writes the bf16 model parameters
(fused_kernels/flat_adamw.py), in place of torch's fused AdamW over per-parameter tensors followed by
megatron's per-parameter fp32 -> bf16 copy.

Layout. megatron's DDP keeps every gradient in one flat buffer per dtype (``buffer.grad_data``;
each parameter's ``main_grad`` is the view ``[start, end)`` of ``buffer.param_index_map``). Each
buffer gets flat fp32 main parameters, exp_avg and exp_avg_sq:
- megatron's plain (Float16 / FP32) optimizer: of the buffer's length, at the gradient's index,
  plus (bf16/fp16 models) a flat copy of the model parameters, which become views of it;
- its distributed optimizer: only this rank's shard of every parameter, packed densely; the
  kernel writes the model parameters into the buffer's own ``param_data``, which megatron then
  all-gathers as usual.
Every main parameter and moment is a view of the flat buffers, so everything else (checkpoints,
the gradient norm, ``param.main_param``, the model's forward) sees the same tensors as before; the
kernel reads the gradients straight from ``grad_data``. The moments are allocated at the first
step (or a load), as torch does, so the first step's transients do not stack on them.

Wiring (``use_flat_adamw``), once, after megatron builds its optimizer and before the first step (so
before CUDA graphs capture the parameters' addresses):
- torch's AdamW ``step`` is replaced by ``FlatAdamW.step``. It honours ``grad_scale`` (the deferred
  1/tokens x clip factor of multimodal/performance/multi_tensor.py) as torch's fused kernel does, without
  writing the unscaled gradient back.
- megatron's ``_copy_main_params_to_model_params`` is skipped right after a flat step (the kernel
  wrote the model parameters); called at any other time (checkpoint loading), it copies.
- after torch's ``load_state_dict`` (which installs freshly allocated moments), the loaded values
  are copied into the flat buffers and the views re-installed.

State stays torch's format (per-parameter ``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints
move freely between runs with and without it. The step count is also kept as a Python int, so
the bias corrections need no device read.

A step with a non-finite gradient norm (the optimizer's ``found_inf``, multimodal/nonfinite.py)
is skipped by the kernel on the device; the host step count is corrected when that is read.

Not covered (``use_flat_adamw`` logs why and torch's fused AdamW runs as before): megatron FSDP, the
precision-aware optimizer, quantized parameters, Adam with L2 decay, amsgrad, maximize,
capturable, gradients not reduced in fp32, a parameter outside the DDP buffers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from core import compat
from fused_kernels.flat_adamw import chunk_table, flat_adamw
from fused_kernels.triton_support import unavailable_reason

log = logging.getLogger(__name__)


@dataclass
class _FlatBuffer:
    """The flat companions of one DDP gradient buffer, and the work tables of each param group."""
    grad: torch.Tensor                      # buffer.grad_data (fp32)
    main: torch.Tensor                      # fp32 main parameters (this rank's shard, packed, if sharded)
    exp_avg: torch.Tensor | None            # None until the first step
    exp_avg_sq: torch.Tensor | None
    out: torch.Tensor | None                # where the kernel writes the model parameters; None: main is the model
    segments: dict[int, list] = field(default_factory=dict)   # group index -> [(start, state start, numel)]
    tables: dict[int, tuple] = field(default_factory=dict)    # group index -> chunk_table(...)


@dataclass
class _Param:
    """One optimized parameter: ``numel`` elements at ``start`` of its buffer's gradient (and output)
    index space and at ``state_start`` of the flat main parameters and moments."""
    model: torch.nn.Parameter
    main: torch.Tensor
    group: int
    buffer: object
    start: int
    state_start: int
    numel: int


class FlatAdamW:
    """Replaces one torch AdamW's step; see the module docstring."""

    def __init__(self, adam: torch.optim.AdamW, megatron_opt, params: list[_Param], sharded: bool, use_kernel: bool):
        """``params``: every parameter ``adam`` updates (``layout`` builds them). ``sharded``: megatron's
        distributed optimizer, whose main parameters are this rank's shard of each buffer and whose
        model parameters already live in the buffer's ``param_data`` (the kernel writes there, then
        megatron all-gathers it)."""
        self.adam = adam
        self.use_kernel = use_kernel
        self.params = params
        self.sharded = sharded
        self.overlap = None  # multimodal/performance/overlap_update.py: the step runs behind the next forward
        self.model_params_fresh = False
        self.skip = None  # the found_inf flag of the step being taken (see step)
        device = params[0].main.device
        self.count = 0
        self.step_tensor = torch.tensor(0.0, dtype=torch.float32, device=device)
        self.flat: dict[int, _FlatBuffer] = {}
        for buf in {id(p.buffer): p.buffer for p in params}.values():
            mine = [p for p in params if p.buffer is buf]
            n = sum(p.numel for p in mine) if sharded else buf.grad_data.numel()
            if sharded:
                out = buf.param_data
            elif buf.param_dtype != torch.float32:
                out = torch.zeros(buf.grad_data.numel(), dtype=buf.param_dtype, device=device)
            else:
                out = None
            # the moments come at the first step (or a load), as torch allocates them: the first
            # step's transients (CUDA graph capture, autotuning) then do not stack on them
            self.flat[id(buf)] = _FlatBuffer(grad=buf.grad_data, main=torch.zeros(n, dtype=torch.float32, device=device),
                                             exp_avg=None, exp_avg_sq=None, out=out)
        self.views = []  # (main_param, flat buffer, state start, numel) for binding the moments
        for p in params:
            fb = self.flat[id(p.buffer)]
            state = slice(p.state_start, p.state_start + p.numel)
            fb.main[state].copy_(p.main.data.view(-1))
            p.main.data = fb.main[state].view_as(p.main)
            if not sharded and fb.out is not None and p.model is not p.main:
                fb.out[p.start:p.start + p.numel].copy_(p.model.data.view(-1))
                p.model.data = fb.out[p.start:p.start + p.numel].view_as(p.model)
            fb.segments.setdefault(p.group, []).append((p.start, p.state_start, p.numel))
            self.views.append((p.main, fb, p.state_start, p.numel))
        for fb in self.flat.values():
            fb.tables = {g: chunk_table(sorted(segs), device) for g, segs in fb.segments.items()}
        if any(self.adam.state.get(main) for main, *_ in self.views):  # installed over existing state
            self.bind_state()
        adam.step = self.step
        adam.flat_adamw = self  # multimodal/checkpointing.py binds the moments before a resume
        adam.register_load_state_dict_post_hook(lambda _opt: self._rebind_after_load())
        copy_name = compat.COPY_MAIN_TO_MODEL.last  # the same method on the distributed optimizer
        original_copy = getattr(megatron_opt, copy_name, None)
        if original_copy is None:  # FP32Optimizer: the model parameters are the main parameters
            return

        def copy_main_to_model():
            if self.model_params_fresh:  # the kernel already wrote them
                self.model_params_fresh = False
                return
            original_copy()
        setattr(megatron_opt, copy_name, copy_main_to_model)

    def bind_state(self) -> None:
        """Make every parameter's exp_avg / exp_avg_sq views of the flat moments (allocated here the
        first time), keeping values already in the state, and point its ``step`` at ours."""
        states = [self.adam.state[main] for main, *_ in self.views]
        steps = {float(st["step"]) for st in states if "step" in st}
        if len(steps) > 1:
            raise RuntimeError(f"flat AdamW: parameters are at different steps {sorted(steps)}")
        self.count = int(steps.pop()) if steps else self.count
        self.step_tensor.fill_(float(self.count))
        for fb in self.flat.values():
            if fb.exp_avg is None:
                fb.exp_avg = torch.zeros_like(fb.main)
                fb.exp_avg_sq = torch.zeros_like(fb.main)
        for (main_param, fb, start, numel), state in zip(self.views, states):
            for key, flat in (("exp_avg", fb.exp_avg), ("exp_avg_sq", fb.exp_avg_sq)):
                view = flat[start:start + numel].view_as(main_param)
                if key in state and state[key] is not view:
                    view.copy_(state[key])
                state[key] = view
            state["step"] = self.step_tensor

    def set_step(self, count: int) -> None:
        """The number of steps taken (a resume under the distributed optimizer restores it)."""
        self.count = count
        self.step_tensor.fill_(float(count))
        for main, *_ in self.views:
            if self.adam.state.get(main):
                self.adam.state[main]["step"] = self.step_tensor

    def uncount(self, skipped: int) -> None:
        """Take back steps the kernel skipped on the device (non-finite gradients): the host count
        only learns of them when the guard reads its counters (log steps, saves), so the bias
        corrections of the steps in between run that many steps ahead."""
        if skipped:
            self.set_step(self.count - skipped)

    def _rebind_after_load(self) -> None:
        """torch's load_state_dict installed freshly allocated moments: copy them into the flat ones."""
        if not any(self.adam.state.get(main) for main, *_ in self.views):
            return  # a checkpoint from before the first step: nothing to bind yet
        self.bind_state()
        self.model_params_fresh = False
        log.info("flat AdamW: loaded optimizer state copied into the flat buffers (step %d)", self.count)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("flat AdamW takes no closure")
        # torch's convention for a step to skip on the device (multimodal/nonfinite.py sets it); the
        # kernel leaves everything but the gradient zeroing undone where it is nonzero
        self.skip = getattr(self.adam, "found_inf", None)
        if any(fb.exp_avg is None for fb in self.flat.values()):
            self.bind_state()
        self.count += 1
        self.step_tensor.fill_(float(self.count))
        grad_scale = getattr(self.adam, "grad_scale", None)
        if self.overlap is not None:  # in pieces, in forward order, on the update stream
            self.overlap.run(self, grad_scale)
        else:
            for fb in self.flat.values():
                for group_index, table in fb.tables.items():
                    self.update(fb, group_index, table, grad_scale)
        self.model_params_fresh = any(fb.out is not None for fb in self.flat.values())

    def update(self, fb: _FlatBuffer, group_index: int, table: tuple, grad_scale, zero_grad: bool = False) -> None:
        """One kernel launch: the chunks of ``table`` (in ``fb``'s index spaces) with group ``group_index``'s
        hyper-parameters, at the step count already advanced by ``step``."""
        group = self.adam.param_groups[group_index]
        beta1, beta2 = group["betas"]
        flat_adamw(fb.main, fb.grad, fb.exp_avg, fb.exp_avg_sq, fb.out, *table,
                   lr=float(group["lr"]), weight_decay=float(group["weight_decay"]), beta1=beta1,
                   beta2=beta2, eps=group["eps"], step=self.count, grad_scale=grad_scale,
                   zero_grad=zero_grad, skip=self.skip, use_kernel=self.use_kernel)

    def piece_tables(self, piece_of: dict, pieces: int) -> list[list[tuple]]:
        """The work split into ``pieces`` parts: per part, [(flat buffer, group index, chunk table)].
        ``piece_of``: parameter -> its part (parameters not in it go to part 0)."""
        segments: list[dict] = [{} for _ in range(pieces)]
        for p in self.params:
            fb = self.flat[id(p.buffer)]
            part = segments[piece_of.get(p.model, 0)]
            part.setdefault((id(fb), p.group), (fb, []))[1].append((p.start, p.state_start, p.numel))
        device = self.params[0].main.device
        return [[(fb, group, chunk_table(sorted(segs), device)) for (_, group), (fb, segs) in part.items()]
                for part in segments]


def _why_not(megatron_opt, adam) -> str | None:
    if getattr(getattr(megatron_opt, "ddp_config", None), "use_megatron_fsdp", False):
        return "megatron FSDP keeps its own parameter buffers"
    if getattr(megatron_opt.config, "use_precision_aware_optimizer", False):
        return "the precision-aware optimizer keeps its own main parameters"
    if not isinstance(adam, (torch.optim.Adam, torch.optim.AdamW)):
        return f"the optimizer is {type(adam).__name__}, not AdamW"
    if not isinstance(adam, torch.optim.AdamW) and not all(g.get("decoupled_weight_decay") for g in adam.param_groups):
        return "Adam with L2 weight decay (the kernel decays decoupled, as AdamW)"
    for g in adam.param_groups:
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if g.get(flag):
                return f"a parameter group sets {flag}"
    return None


def _sharded(megatron_opt) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(megatron_opt, DistributedOptimizer)


def _model_main_pairs(megatron_opt):
    """(model_param, main_param, group_index) for every parameter the optimizer updates."""
    if _sharded(megatron_opt):  # main params: this rank's shards
        groups = zip(megatron_opt.model_float16_groups, megatron_opt.shard_fp32_from_float16_groups,
                     megatron_opt.model_fp32_groups, megatron_opt.shard_fp32_groups)
        for gi, (models, mains, fp32_models, fp32_mains) in enumerate(groups):
            yield from ((mp, main, gi) for mp, main in zip(models, mains))
            yield from ((mp, main, gi) for mp, main in zip(fp32_models, fp32_mains))
    elif hasattr(megatron_opt, "float16_groups"):  # Float16OptimizerWithFloat16Params
        for gi, (models, mains, fp32s) in enumerate(zip(megatron_opt.float16_groups,
                                                        megatron_opt.fp32_from_float16_groups,
                                                        megatron_opt.fp32_from_fp32_groups)):
            yield from ((mp, main, gi) for mp, main in zip(models, mains))
            yield from ((p, p, gi) for p in fp32s)
    else:  # FP32Optimizer: the model parameters are the main parameters
        for gi, group in enumerate(megatron_opt.optimizer.param_groups):
            yield from ((p, p, gi) for p in group["params"])


def layout(megatron_opt, owner: dict) -> list[_Param] | str:
    """Where each parameter's gradient, output, main parameter and moments sit in the flat buffers;
    or why there is no such layout. ``owner``: model parameter -> its DDP gradient buffer."""
    sharded = _sharded(megatron_opt)
    params, next_state = [], {}
    for model_param, main_param, group in _model_main_pairs(megatron_opt):
        buf = owner.get(model_param)
        if buf is None:
            return "a parameter is outside the DDP gradient buffers"
        if main_param is None:
            return "a parameter has no fp32 main copy (quantized parameters)"
        if sharded:  # this rank's shard: at its world range of the buffer, packed densely for the state
            world = getattr(megatron_opt, compat.PARAM_RANGE_MAP.last)(model_param)["gbuf_world"]
            start, numel = world.start, world.size
            state_start = next_state.get(id(buf), 0)
            next_state[id(buf)] = state_start + numel
            if buf.param_data is None:
                return "the distributed optimizer's buffer has no param_data"
        else:
            start, end, _ = buf.param_index_map[model_param]
            numel, state_start = end - start, start
        if main_param.numel() != numel:
            return f"a main parameter has {main_param.numel()} elements where its range has {numel}"
        params.append(_Param(model_param, main_param, group, buf, start, state_start, numel))
    if not params:
        return "no parameters"
    if any(p.buffer.grad_data.dtype != torch.float32 for p in params):
        return "gradients are not reduced in fp32"
    return params


def use_flat_adamw(optimizer, ddp_chunks, requested: bool | None) -> list[FlatAdamW]:
    """Put flat AdamW under every torch AdamW of ``optimizer`` (a megatron optimizer, maybe chained)
    whose parameters it covers. ``requested``: True / False / None (= on a CUDA device with Triton).
    Returns the installed instances; logs why when one is not installed."""
    if requested is False:
        return []
    buffers = [b for chunk in ddp_chunks for b in chunk.buffers + chunk.expert_parallel_buffers]
    owner = {p: b for b in buffers for p in b.param_index_map}
    installed = []
    for mopt in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = getattr(mopt, "optimizer", None)
        if adam is None or getattr(mopt, "is_stub_optimizer", False):
            continue
        why = _why_not(mopt, adam)
        params = layout(mopt, owner) if why is None else why
        if isinstance(params, str):
            why = params
        use_kernel = False
        if not why:
            kernel_problem = unavailable_reason(params[0].main)
            use_kernel = kernel_problem is None
            if kernel_problem and requested is None:
                why = kernel_problem
            elif kernel_problem:
                log.warning("optimizer.flat=true without the Triton kernel (%s): the PyTorch reference "
                            "runs instead, correct but slow", kernel_problem)
        if why:
            # loud where the kernel was asked for or expected (a GPU), quiet on a CPU by default
            on_gpu = not isinstance(params, str) and params[0].main.is_cuda
            (log.warning if requested or on_gpu else log.info)("optimizer: torch's fused AdamW stays (%s)", why)
            continue
        flat = FlatAdamW(adam, mopt, params, _sharded(mopt), use_kernel)
        installed.append(flat)
        log.info("optimizer: flat AdamW over %d parameters in %d buffer(s)%s%s", len(params), len(flat.flat),
                 " (this rank's shards)" if _sharded(mopt) else "",
                 ", writing the bf16 model parameters in the same kernel"
                 if any(fb.out is not None and fb.out.dtype != torch.float32 for fb in flat.flat.values()) else "")
    return installed
