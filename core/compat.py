"""The megatron-core internals this project patches, overrides or reads, in one list.

megatron-core does not promise these names (module-level hooks, ``_``-prefixed functions and
methods): an upgrade may rename or drop any of them, and the patch that needs it would then fail
deep in a step, or silently patch nothing. ``check()`` runs once at start-up
(multimodal/platform.py, ``init_distributed``) and stops in one line naming the missing name and
the file that needs it. The patch sites take their names from here (``get`` / ``replace``).

Imports nothing of the project (it is part of ``core/``); megatron is imported when checked.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

TESTED_VERSION = "0.19.2"  # the megatron-core every name below was checked against


@dataclass(frozen=True)
class Internal:
    """``attr`` (dotted: ``Class.method``) inside the megatron-core module ``module``, used by ``user``.
    ``global_read``: a global the module's code reads but only defines when an optional extension
    imports; it is checked in the module's source."""

    module: str
    attr: str
    user: str
    global_read: bool = False

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}"

    @property
    def last(self) -> str:
        """The attribute's own name (for reading or shadowing it on an instance)."""
        return self.attr.rsplit(".", 1)[-1]

    def owner(self) -> tuple[object, str]:
        """(the object holding the last name, that name)."""
        obj = importlib.import_module(self.module)
        *path, last = self.attr.split(".")
        for part in path:
            obj = getattr(obj, part)
        return obj, last


_OPT = "megatron.core.optimizer.optimizer"
_CLIP = "megatron.core.optimizer.clip_grads"
_DIST_OPT = "megatron.core.optimizer.distrib_optimizer"
_RANDOM = "megatron.core.tensor_parallel.random"
_PLATFORM = "multimodal/platform.py"
_MULTI_TENSOR = "multimodal/performance/multi_tensor.py"

# multimodal/performance/multi_tensor.py: megatron's multi-tensor hooks, filled with torch kernels
LOCAL_L2_NORM = Internal("megatron.core.utils", "local_multi_tensor_l2_norm", _MULTI_TENSOR)
CLIP_APPLIER = Internal(_CLIP, "multi_tensor_applier", _MULTI_TENSOR)
CLIP_L2_NORM = Internal(_CLIP, "l2_norm_impl", _MULTI_TENSOR)
CLIP_SCALE = Internal(_CLIP, "multi_tensor_scale_impl", _MULTI_TENSOR)
CLIP_SCALE_TENSOR = Internal(_CLIP, "multi_tensor_scale_tensor_impl", _MULTI_TENSOR)
OPT_APPLIER = Internal(_OPT, "multi_tensor_applier", _MULTI_TENSOR)
OPT_SCALE = Internal(_OPT, "multi_tensor_scale_impl", _MULTI_TENSOR)
# multimodal/performance/flat_adamw_patch.py: the copy flat AdamW's kernel makes redundant, and the
# distributed optimizer's shard ranges
COPY_MAIN_TO_MODEL = Internal(_OPT, "Float16OptimizerWithFloat16Params._copy_main_params_to_model_params",
                              "multimodal/performance/flat_adamw_patch.py")
DIST_COPY_MAIN_TO_MODEL = Internal(_DIST_OPT, "DistributedOptimizer._copy_main_params_to_model_params",
                                   "multimodal/performance/flat_adamw_patch.py")
PARAM_RANGE_MAP = Internal(_DIST_OPT, "DistributedOptimizer._get_model_param_range_map",
                           "multimodal/performance/flat_adamw_patch.py")
# multimodal/performance/recompute.py: megatron's checkpoint saves the CUDA RNG state (none on a CPU)
GET_CUDA_RNG_STATE = Internal(_RANDOM, "_get_cuda_rng_state", "multimodal/performance/recompute.py")
SET_CUDA_RNG_STATE = Internal(_RANDOM, "_set_cuda_rng_state", "multimodal/performance/recompute.py")
# multimodal/platform.py: CUDA-only spots patched for a CPU run
CLIP_BY_TOTAL_NORM = Internal(_OPT, "clip_grad_by_total_norm_fp32", _PLATFORM)
SPLIT_SIZES_TO_CPU = Internal("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu", _PLATFORM)
SETUP_EMBEDDINGS = Internal("megatron.core.models.common.language_module.language_module",
                            "LanguageModule.setup_embeddings_and_output_layer", _PLATFORM)
BUILD_PARAM_GROUPS = Internal(_DIST_OPT, "DistributedOptimizer._build_model_and_main_param_groups", _PLATFORM)
# the all-gather / reduce-scatter of a variable number of rows per rank (the MoE dispatcher's expert TP)
GATHER_FIRST_DIM = Internal("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim", _PLATFORM)
REDUCE_SCATTER_FIRST_DIM = Internal("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim",
                                    _PLATFORM)
RNG_TRACKER = Internal(_RANDOM, "_CUDA_RNG_STATE_TRACKER", _PLATFORM)
RNG_TRACKER_INITIALIZED = Internal(_RANDOM, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", _PLATFORM)
INIT_RNG_TRACKER = Internal(_RANDOM, "initialize_rng_tracker", _PLATFORM)
# megatron modules on the training path that allocate small tensors with device="cuda": on a CPU
# their ``torch`` is replaced by one that allocates there (multimodal/platform.py)
CUDA_ALLOCATING: tuple[Internal, ...] = tuple(Internal(module, "torch", _PLATFORM) for module in (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.pipeline_parallel.schedules",
    # pipeline p2p: receive buffers on torch.cuda.current_device() and a torch.cuda.synchronize()
    # after every batched isend/irecv (a race guard for NCCL; gloo's waits are already blocking)
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.utils",
))
# models/performance/wgrad_fusion.py: the fused weight-gradient path megatron takes from its CUDA extension
WGRAD_EXTENSION = Internal("megatron.core.tensor_parallel.layers", "fused_weight_gradient_mlp_cuda",
                           "models/performance/wgrad_fusion.py", global_read=True)
WGRAD_AVAILABLE = Internal("megatron.core.tensor_parallel.layers", "_grad_accum_fusion_available",
                           "models/performance/wgrad_fusion.py")
# models/common/fp8.py: the linear layers' GEMM entry, shadowed per module by the FP8 one
COLUMN_FORWARD_IMPL = Internal("megatron.core.tensor_parallel.layers", "ColumnParallelLinear._forward_impl",
                               "models/common/fp8.py")
ROW_FORWARD_IMPL = Internal("megatron.core.tensor_parallel.layers", "RowParallelLinear._forward_impl",
                            "models/common/fp8.py")
# elsewhere: a module-level queue, a router function wrapped, a schedule-plan method overridden
RESULTS_QUEUE = Internal("megatron.core.dist_checkpointing.strategies.filesystem_async", "_results_queue",
                         "multimodal/async_saves.py")
TOKENS_PER_EXPERT = Internal("megatron.core.transformer.moe.router", "get_tokens_per_expert_and_token_count",
                             "models/common/moe_aux_loss.py")
LAYER_CALLABLE_NODES = Internal("megatron.core.models.common.model_chunk_schedule_plan",
                                "TransformerLayerSchedulePlan._build_callable_nodes", "models/common/schedule_plan.py")

INTERNALS: tuple[Internal, ...] = (*(v for v in dict(globals()).values() if isinstance(v, Internal)), *CUDA_ALLOCATING)


class MegatronCompatError(RuntimeError):
    """A megatron-core internal this project needs is gone (an upgrade renamed or dropped it)."""


def missing(internals=INTERNALS) -> Internal | None:
    """The first listed internal the installed megatron-core lacks, None when all are there."""
    for internal in internals:
        try:
            obj, last = internal.owner()
        except (ImportError, AttributeError):
            return internal
        if internal.global_read:
            import inspect

            if f"{last}." not in inspect.getsource(obj):
                return internal
        elif not hasattr(obj, last):
            return internal
    return None


_CHECKED: list[bool] = []  # the full list passed once in this process


def check(internals=INTERNALS) -> None:
    """Stop in one line when the installed megatron-core lacks a listed internal."""
    if internals is INTERNALS and _CHECKED:
        return
    gone = missing(internals)
    if gone is None:
        if internals is INTERNALS:
            _CHECKED.append(True)
        return
    try:
        from importlib.metadata import version

        installed = version("megatron-core")
    except Exception:  # noqa: BLE001 - the version only adds context to the message
        installed = "unknown"
    raise MegatronCompatError(
        f"megatron-core {installed} has no {gone.name}, which {gone.user} needs; install megatron-core=="
        f"{TESTED_VERSION} (the version it was written against) or update {gone.user} (names in core/compat.py)")


def get(internal: Internal):
    obj, last = internal.owner()
    return getattr(obj, last)


def replace(internal: Internal, value) -> None:
    """Set the internal to ``value`` (a module attribute or a class attribute)."""
    obj, last = internal.owner()
    setattr(obj, last, value)
