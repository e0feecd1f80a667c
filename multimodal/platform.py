"""Device and process-group set-up, plus the few patches megatron-core needs on a CPU.

megatron-core assumes CUDA in a handful of places (``torch.cuda.current_device()`` as
an allocation device, ``device='cuda'`` in gradient clipping, the CUDA RNG tracker).
On a machine without a GPU we keep megatron-core unchanged and patch exactly those
places, once, at start-up. Nothing here runs when a GPU is present.

Patched on CPU only (each one is listed in ``CPU_PATCHES`` so tests can assert them):
- ``torch.cuda.current_device`` returns ``torch.device("cpu")``: megatron uses it as
  the device for parameters, rotary buffers and scratch tensors.
- the modules in ``core.compat.CUDA_ALLOCATING`` (optimizer, grad clipping, schedules,
  grad buffers, MoE, dist-checkpointing) see a ``torch`` whose factories turn
  ``device='cuda'`` into CPU; ``clip_grad_by_total_norm_fp32`` (which asserts CUDA
  gradients) gets a CPU twin; the MoE all-to-all split sizes become numpy as on a GPU.
- ``megatron.core.tensor_parallel.mappings``' all-gather and reduce-scatter along the first
  dimension: with a row count per rank (the MoE dispatcher over expert TP with EP > 1) NCCL
  takes tensors of different sizes, gloo does not; the rows are padded to the largest count.
- ``megatron.core.tensor_parallel.random`` CUDA RNG tracker: replaced by one that forks
  the CPU generator, so model-parallel seeding keeps its meaning on CPU.
- pipeline parallelism: ``LanguageModule.setup_embeddings_and_output_layer`` moves the tied
  output weight of the last stage with ``Tensor.cuda()`` before the all-reduce that copies
  the first stage's embedding into it; on CPU that call runs with ``Tensor.cuda`` as identity.
- distributed optimizer: it accepts parameters only if ``param.type()`` is a
  ``torch.cuda.*Tensor`` string; while it builds its parameter groups, CPU parameters report
  the CUDA name of the same dtype (nothing else in it depends on the device).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from core import compat

log = logging.getLogger(__name__)

CPU_PATCHES: list[str] = []
# True only where a test has replaced the CUDA streams and events of megatron's overlapped MoE
# schedule with CPU stand-ins (tests/test_moe_overlap.py); real CPU runs refuse the overlap.
CPU_STREAM_STAND_INS = False


@dataclass(frozen=True)
class Runtime:
    """What the rest of the program needs to know about where it runs."""

    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    backend: str

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_minutes: int = 30) -> Runtime:
    """Start torch.distributed (NCCL on GPU, gloo on CPU); works without torchrun too."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    compat.check()  # a megatron-core without an internal we patch stops here, in one line
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        apply_cpu_patches()
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        # one process without a launcher: an in-memory store, no TCP port to race for (a port
        # picked free and bound a moment later can be taken by another job in between)
        store = dist.HashStore() if world_size == 1 and "TORCHELASTIC_RUN_ID" not in os.environ else None
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
            store=store,
        )
    return Runtime(device, rank, world_size, local_rank, backend)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def apply_cpu_patches() -> None:
    """Make megatron-core run on a CPU-only machine. Idempotent; no-op with a GPU."""
    if torch.cuda.is_available() or CPU_PATCHES:
        return
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    CPU_PATCHES.append("torch.cuda.current_device")

    for internal in compat.CUDA_ALLOCATING:
        compat.replace(internal, _CudaToCpuTorch())
    CPU_PATCHES.append("'cuda' scalar allocations -> CPU in " + ", ".join(i.module for i in compat.CUDA_ALLOCATING))
    # clip_grad_by_total_norm_fp32 asserts grads are torch.cuda.FloatTensor: CPU twin below.
    compat.replace(compat.CLIP_BY_TOTAL_NORM, _clip_grad_by_total_norm_fp32)
    CPU_PATCHES.append(compat.CLIP_BY_TOTAL_NORM.name)
    compat.replace(compat.SPLIT_SIZES_TO_CPU, _split_sizes_to_host)
    CPU_PATCHES.append(compat.SPLIT_SIZES_TO_CPU.name)
    for internal, fn in ((compat.GATHER_FIRST_DIM, _gather_rows_padded),
                         (compat.REDUCE_SCATTER_FIRST_DIM, _reduce_scatter_rows_padded)):
        compat.replace(internal, fn(compat.get(internal)))
        CPU_PATCHES.append(f"{internal.name} (per-rank row counts padded: gloo needs equal shapes)")
    compat.replace(compat.SETUP_EMBEDDINGS, _with_tensor_cuda_as_identity(compat.get(compat.SETUP_EMBEDDINGS)))
    CPU_PATCHES.append(f"{compat.SETUP_EMBEDDINGS.name} (Tensor.cuda -> identity)")
    build_groups = compat.get(compat.BUILD_PARAM_GROUPS).__func__
    compat.replace(compat.BUILD_PARAM_GROUPS, classmethod(_with_cuda_type_names(build_groups)))
    CPU_PATCHES.append(f"{compat.BUILD_PARAM_GROUPS.name} (CUDA type names)")
    compat.replace(compat.RNG_TRACKER, CpuRngStatesTracker())
    compat.replace(compat.RNG_TRACKER_INITIALIZED, True)
    compat.replace(compat.INIT_RNG_TRACKER, lambda *a, **k: None)
    CPU_PATCHES.append("megatron.core.tensor_parallel.random RNG tracker")
    # the places, one per line, only at DEBUG: the count says enough on a normal start
    log.info("CPU run: %d CUDA-only spots of megatron-core patched to run on the CPU "
             "(multimodal/platform.py)", len(CPU_PATCHES))
    log.debug("CPU patches: %s", ", ".join(CPU_PATCHES))


def _with_tensor_cuda_as_identity(fn):
    """``fn`` with ``Tensor.cuda()`` returning the tensor itself while it runs (CPU only)."""

    def wrapped(*args, **kwargs):
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = saved  # type: ignore[method-assign]

    wrapped.__wrapped__ = fn
    return wrapped


_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


def _with_cuda_type_names(fn):
    """``fn`` with CPU parameters' ``type()`` named as their CUDA twins while it runs (CPU only)."""

    def wrapped(*args, **kwargs):
        had = "type" in vars(torch.nn.Parameter)
        saved = torch.nn.Parameter.type

        def cuda_name(self, *a, **k):
            name = saved(self, *a, **k)
            return _CUDA_TYPE_NAMES.get(name, name) if not (a or k) else name

        torch.nn.Parameter.type = cuda_name  # type: ignore[method-assign]
        try:
            return fn(*args, **kwargs)
        finally:
            if had:
                torch.nn.Parameter.type = saved  # type: ignore[method-assign]
            else:
                del torch.nn.Parameter.type

    wrapped.__wrapped__ = fn
    return wrapped


class _CudaToCpuTorch:
    """Stands in for ``torch`` inside a megatron module: factories asked for 'cuda' get CPU.

    megatron's optimizer and gradient-norm code allocate small scalars with
    ``device='cuda'``; everything else is forwarded to the real torch module.
    """

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full")

    @property
    def cuda(self):
        return _CpuStreams()

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name not in self._FACTORIES:
            return attr

        def factory(*args, **kwargs):
            dev = kwargs.get("device")
            if dev is not None and torch.device(dev).type == "cuda":
                kwargs["device"] = "cpu"
            return attr(*args, **kwargs)

        return factory


class _NoStream:
    """A CUDA stream/event stand-in: on the CPU every op is already ordered."""

    def wait_stream(self, *_):
        pass

    def wait_event(self, *_):
        pass

    def synchronize(self):
        pass

    def record_event(self, *_):
        return _NoStream()

    def query(self):
        return True


class _CpuStreams:
    """``torch.cuda`` as seen by the patched megatron modules: streams are no-ops."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    current_stream = staticmethod(lambda *a, **k: _NoStream())
    Stream = staticmethod(lambda *a, **k: _NoStream())
    Event = staticmethod(lambda *a, **k: _NoStream())
    stream = staticmethod(lambda *a, **k: contextlib.nullcontext())
    current_device = staticmethod(lambda: torch.device("cpu"))
    synchronize = staticmethod(lambda *a, **k: None)
    is_available = staticmethod(lambda: False)


def _split_sizes_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron moves all-to-all split sizes GPU -> numpy; on CPU they stayed tensors, which
    ``all_to_all_single`` rejects. Same result as megatron's helper on a GPU."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().cpu().numpy()
    return tensor.cpu() if torch.is_tensor(tensor) else tensor


def _gather_rows_padded(gather):
    """megatron's all-gather along the first dimension. With ``output_split_sizes`` (a row count per
    rank: megatron's all-to-all dispatcher gathers the tokens routed to this rank's experts over
    expert TP) NCCL gathers tensors of different sizes and gloo refuses them, so each rank's rows
    are padded to the largest count, gathered, and the padding dropped."""

    def wrapped(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        most = max(output_split_sizes)
        padded = input_.new_zeros((most, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((most * group.size(), *input_.shape[1:]))
        dist.all_gather_into_tensor(out, padded, group=group)
        return torch.cat([out[i * most : i * most + n] for i, n in enumerate(output_split_sizes)])

    wrapped.__wrapped__ = gather
    return wrapped


def _reduce_scatter_rows_padded(reduce_scatter):
    """megatron's reduce-scatter along the first dimension; with ``input_split_sizes`` (rank i gets
    the sum of everyone's i-th slice, of its own row count: the dispatcher's expert-TP combine) every
    slice is padded to the largest count for gloo, which reduce-scatters equal shapes only."""

    def wrapped(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        most = max(input_split_sizes)
        padded = input_.new_zeros((most * group.size(), *input_.shape[1:]))
        for i, rows in enumerate(torch.split(input_, list(input_split_sizes), dim=0)):
            padded[i * most : i * most + rows.shape[0]] = rows
        out = input_.new_empty((most, *input_.shape[1:]))
        dist.reduce_scatter_tensor(out, padded, group=group)
        return out[: input_split_sizes[group.rank()]]

    wrapped.__wrapped__ = reduce_scatter
    return wrapped


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff >= 1.0:
        return
    for p in parameters:
        g = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
        if g is not None:
            g.detach().mul_(coeff)


class CpuRngStatesTracker:
    """Named RNG streams on the CPU generator, with the interface megatron expects.

    megatron forks a separate stream for tensor-parallel regions (dropout, init of
    partitioned weights) so that ranks differ there and agree elsewhere.
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return True

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        if name in self.states_:
            raise RuntimeError(f"RNG state {name} already exists")
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)
        self.seeds_.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"RNG state {name} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def use_deterministic_algorithms(enabled: bool) -> None:
    """train.deterministic: torch's deterministic kernels wherever one exists (megatron-core then
    also picks them: e.g. the MoE combine becomes an ordered ``index_add`` instead of ``scatter_add``
    with float atomics, whose summation order, and so whose bf16 result, changes from run to run).
    Ops without a deterministic version warn instead of stopping the run; cuBLAS needs a fixed
    workspace, set here before its first use."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=True)


class StopSignals:
    """SIGTERM (a scheduler's pre-emption, ``kill``) sets a flag that the step loop reads between
    steps: the run then completes the checkpoint being written and stops in one line. SIGINT keeps
    Python's KeyboardInterrupt (it also stops the data workers) and the loop reports it the same way."""

    def __init__(self):
        self.signal: int | None = None
        self._previous = None

    def install(self) -> "StopSignals":
        def handler(signum, frame):
            self.signal = signum
        try:
            self._previous = signal.signal(signal.SIGTERM, handler)
        except ValueError:  # not the main thread (tests driving the loop from a thread)
            self._previous = None
        return self

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def error(self, step: int, latest: str | None, cfg):
        return _stopped("SIGTERM", signal.SIGTERM, step, latest, cfg)

    @staticmethod
    def interrupted(step: int, latest: str | None, cfg):
        return _stopped("interrupted (SIGINT)", signal.SIGINT, step, latest, cfg)


def _stopped(what: str, signum: int, step: int, latest: str | None, cfg):
    from core.errors import Stopped

    if latest:
        back = (f"last checkpoint {latest}; resume: the same command with checkpoint.load=latest"
                + ("" if cfg.checkpoint.load == "latest" else f" checkpoint.dir={cfg.checkpoint.dir}"))
    elif cfg.checkpoint.dir:
        back = "no checkpoint written yet (checkpoint.interval sets how often); a rerun starts from step 0"
    else:
        back = "no checkpoints (checkpoint.dir=null); a rerun starts from step 0"
    return Stopped(f"{what} after step {step}; {back}", signum)


def transformers_torch_kernels(model_name: str = "qwen35_vl") -> bool:
    """On a machine without a GPU, make transformers' Qwen3.5 modules run their own PyTorch Gated
    DeltaNet and causal-conv functions: transformers takes flash-linear-attention's Triton kernels
    whenever ``fla`` imports (it does in this environment), and those fail on a CPU with
    "RuntimeError: 0 active drivers". One line before running an exported checkpoint with
    transformers on a CPU (``import multimodal.platform as p; p.transformers_torch_kernels()``);
    returns whether it switched (not on a GPU, where the kernels work)."""
    if torch.cuda.is_available():
        return False
    from models import get_hf_adapter, get_model_family

    get_hf_adapter(get_model_family(model_name)).use_hf_torch_kernels()
    return True
