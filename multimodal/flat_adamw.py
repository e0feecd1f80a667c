"""AdamW over flat buffers for megatron-core's (non-distributed) optimizer: one kernel per parameter
group that updates the fp32 main parameters and both moments and writes the bf16 model parameters
(kernels/flat_adamw.py), in place of torch's fused AdamW over per-parameter tensors followed by
megatron's per-parameter fp32 -> bf16 copy.

Layout. megatron's DDP keeps every gradient in one flat buffer per dtype (``buffer.grad_data``;
each parameter's ``main_grad`` is the view ``[start, end)`` of ``buffer.param_index_map``). Here
each such buffer gets four companions of the same length: the fp32 main parameters, exp_avg,
exp_avg_sq and (for bf16/fp16 models) the model parameters. Every main parameter, model parameter
and moment becomes a view of its own ``[start, end)``, so everything else (checkpoints, the
gradient norm, ``param.main_param``, the model's forward) sees the same tensors as before; the
kernel reads the gradients straight from ``grad_data``.

Wiring (``install``), once, after megatron builds its optimizer and before the first step (so
before CUDA graphs capture the parameters' addresses):
- torch's AdamW ``step`` is replaced by ``FlatAdamW.step``. It honours ``grad_scale`` (the deferred
  1/tokens x clip factor of multimodal/multi_tensor.py) as torch's fused kernel does, without
  writing the unscaled gradient back.
- megatron's ``_copy_main_params_to_model_params`` is skipped right after a flat step (the kernel
  wrote the model parameters); called at any other time (checkpoint loading), it copies.
- after torch's ``load_state_dict`` (which installs freshly allocated moments), the loaded values
  are copied into the flat buffers and the views re-installed.

State stays torch's format (per-parameter ``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints
move freely between runs with and without it. The step count is also kept as a Python int, so
the bias corrections need no device read.

Not covered (``install`` returns None and logs why; torch's fused AdamW then runs as before):
megatron's distributed optimizer (sharded main parameters), Adam with L2 decay, amsgrad,
maximize, capturable, gradients not reduced in fp32, a parameter outside the DDP buffers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kernels.flat_adamw import chunk_table, flat_adamw
from kernels.triton_support import unavailable_reason

log = logging.getLogger(__name__)


@dataclass
class _FlatBuffer:
    """The flat companions of one DDP gradient buffer, and the work tables of each param group."""
    grad: torch.Tensor                      # buffer.grad_data (fp32)
    main: torch.Tensor                      # fp32 main parameters
    exp_avg: torch.Tensor | None            # None until the first step
    exp_avg_sq: torch.Tensor | None
    model: torch.Tensor | None              # bf16/fp16 model parameters; None when main is the model
    segments: dict[int, list] = field(default_factory=dict)   # group index -> [(start, numel)]
    tables: dict[int, tuple] = field(default_factory=dict)    # group index -> (starts, lengths)


class FlatAdamW:
    """Replaces one torch AdamW's step; see the module docstring."""

    def __init__(self, adam: torch.optim.AdamW, megatron_opt, pairs, buffers, use_kernel: bool):
        """``pairs``: (model_param, main_param, group_index, buffer) for every optimized parameter;
        ``buffers``: the DDP gradient buffers holding them."""
        self.adam = adam
        self.use_kernel = use_kernel
        self.model_params_fresh = False
        self.device = device = pairs[0][1].device
        self.count = 0
        self.step_tensor = torch.tensor(0.0, dtype=torch.float32, device=device)
        self.flat: dict[int, _FlatBuffer] = {}
        for buf in buffers:
            n = buf.grad_data.numel()
            needs_model = buf.param_dtype != torch.float32
            # the moments come at the first step (or a load), as torch allocates them: the first
            # step's transients (CUDA graph capture, autotuning) then do not stack on them
            self.flat[id(buf)] = _FlatBuffer(
                grad=buf.grad_data, main=torch.zeros(n, dtype=torch.float32, device=device), exp_avg=None,
                exp_avg_sq=None, model=torch.zeros(n, dtype=buf.param_dtype, device=device) if needs_model else None)
        self.views = []  # (main_param, flat buffer, start, end) for binding the moments
        for model_param, main_param, group_index, buf in pairs:
            fb = self.flat[id(buf)]
            start, end, _ = buf.param_index_map[model_param]
            fb.main[start:end].copy_(main_param.data.view(-1))
            main_param.data = fb.main[start:end].view_as(main_param)
            if fb.model is not None and model_param is not main_param:
                fb.model[start:end].copy_(model_param.data.view(-1))
                model_param.data = fb.model[start:end].view_as(model_param)
            fb.segments.setdefault(group_index, []).append((start, end - start))
            self.views.append((main_param, fb, start, end))
        for fb in self.flat.values():
            fb.tables = {g: chunk_table(sorted(segs), device) for g, segs in fb.segments.items()}
        if any(self.adam.state.get(main) for main, *_ in self.views):  # installed over existing state
            self._bind_state()
        adam.step = self.step
        adam.register_load_state_dict_post_hook(lambda _opt: self._rebind_after_load())
        original_copy = getattr(megatron_opt, "_copy_main_params_to_model_params", None)
        if original_copy is None:  # FP32Optimizer: the model parameters are the main parameters
            return

        def copy_main_to_model():
            if self.model_params_fresh:  # the kernel already wrote them
                self.model_params_fresh = False
                return
            original_copy()
        megatron_opt._copy_main_params_to_model_params = copy_main_to_model

    def _bind_state(self) -> None:
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
        for (main_param, fb, start, end), state in zip(self.views, states):
            for key, flat in (("exp_avg", fb.exp_avg), ("exp_avg_sq", fb.exp_avg_sq)):
                view = flat[start:end].view_as(main_param)
                if key in state and state[key] is not view:
                    view.copy_(state[key])
                state[key] = view
            state["step"] = self.step_tensor

    def _rebind_after_load(self) -> None:
        """torch's load_state_dict installed freshly allocated moments: copy them into the flat ones."""
        if not any(self.adam.state.get(main) for main, *_ in self.views):
            return  # a checkpoint from before the first step: nothing to bind yet
        self._bind_state()
        self.model_params_fresh = False
        log.info("flat AdamW: loaded optimizer state copied into the flat buffers (step %d)", self.count)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("flat AdamW takes no closure")
        if getattr(self.adam, "found_inf", None) is not None:
            raise RuntimeError("flat AdamW does not handle found_inf (fp16 loss scaling); set optimizer.flat=false")
        if any(fb.exp_avg is None for fb in self.flat.values()):
            self._bind_state()
        self.count += 1
        self.step_tensor.fill_(float(self.count))
        grad_scale = getattr(self.adam, "grad_scale", None)
        for fb in self.flat.values():
            for group_index, (starts, lengths) in fb.tables.items():
                group = self.adam.param_groups[group_index]
                beta1, beta2 = group["betas"]
                flat_adamw(fb.main, fb.grad, fb.exp_avg, fb.exp_avg_sq, fb.model, starts, lengths,
                           lr=float(group["lr"]), weight_decay=float(group["weight_decay"]), beta1=beta1,
                           beta2=beta2, eps=group["eps"], step=self.count, grad_scale=grad_scale,
                           use_kernel=self.use_kernel)
        self.model_params_fresh = any(fb.model is not None for fb in self.flat.values())


def _why_not(megatron_opt, adam) -> str | None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if isinstance(megatron_opt, DistributedOptimizer):
        return "the distributed optimizer shards the main parameters"
    if not isinstance(adam, (torch.optim.Adam, torch.optim.AdamW)):
        return f"the optimizer is {type(adam).__name__}, not AdamW"
    if not isinstance(adam, torch.optim.AdamW) and not all(g.get("decoupled_weight_decay") for g in adam.param_groups):
        return "Adam with L2 weight decay (the kernel decays decoupled, as AdamW)"
    for g in adam.param_groups:
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if g.get(flag):
                return f"a parameter group sets {flag}"
    return None


def _model_main_pairs(megatron_opt):
    """(model_param, main_param, group_index) for every parameter the optimizer updates."""
    if hasattr(megatron_opt, "float16_groups"):  # Float16OptimizerWithFloat16Params
        for gi, (models, mains, fp32s) in enumerate(zip(megatron_opt.float16_groups,
                                                        megatron_opt.fp32_from_float16_groups,
                                                        megatron_opt.fp32_from_fp32_groups)):
            yield from ((mp, main, gi) for mp, main in zip(models, mains))
            yield from ((p, p, gi) for p in fp32s)
    else:  # FP32Optimizer: the model parameters are the main parameters
        for gi, group in enumerate(megatron_opt.optimizer.param_groups):
            yield from ((p, p, gi) for p in group["params"])


def install(optimizer, ddp_chunks, requested: bool | None) -> list[FlatAdamW]:
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
        pairs = [] if why else [(mp, main, gi, owner.get(mp)) for mp, main, gi in _model_main_pairs(mopt)]
        if not why and any(buf is None for *_, buf in pairs):
            why = "a parameter is outside the DDP gradient buffers"
        if not why and any(buf.grad_data.dtype != torch.float32 for *_, buf in pairs):
            why = "gradients are not reduced in fp32"
        if not why and not pairs:
            why = "no parameters"
        use_kernel = False
        if not why:
            kernel_problem = unavailable_reason(pairs[0][1])
            use_kernel = kernel_problem is None
            if kernel_problem and requested is None:
                why = kernel_problem
            elif kernel_problem:
                log.warning("optimizer.flat=true without the Triton kernel (%s): the PyTorch reference "
                            "runs instead, correct but slow", kernel_problem)
        if why:
            (log.warning if requested else log.info)("optimizer: torch's fused AdamW stays (%s)", why)
            continue
        used = list({id(b): b for *_, b in pairs}.values())
        installed.append(FlatAdamW(adam, mopt, pairs, used, use_kernel))
        log.info("optimizer: flat AdamW over %d parameters in %d buffer(s)%s", len(pairs), len(used),
                 ", writing the bf16 model parameters in the same kernel"
                 if any(b.param_dtype != torch.float32 for b in used) else "")
    return installed
