"""Initial weights that do not depend on the parallel layout: one ``train.seed``, one model.

megatron-core draws each rank's shard from that rank's point of the RNG stream, so a pipeline
stage, an expert rank or a TP shard of the same seed holds other values than one process would.
Here every value is a function of (seed, the tensor's checkpoint key, its position in the global
tensor) only, so any TP/PP/EP/CP/DP layout holds the one-process model's weights.

How a rank's shard maps to the global tensor is megatron's own answer, the one its distributed
checkpoints rely on: ``model.sharded_state_dict()`` gives, for every piece a rank holds, a view of
the parameter, the global key (TP=1 name, global layer index), the global shape and the piece's
offset in it, with GDN's sectioned ``in_proj``/``conv1d`` and fc1's gate/up halves split into
pieces of their own. The global tensor is generated in blocks of whole rows (along dim 0: rows of
a matrix, experts of a stacked expert weight); each block has its own generator, seeded from
(seed, key, first row), so a rank generates only the blocks its piece overlaps, never a whole
TP=1 copy, and any cut of the rows gets the same values.

Each parameter keeps the distribution megatron (or torch, for the plain modules of the vision
tower) gives it today (``rule_of``): N(0, init_method_std), the scaled N(0, std / sqrt(2 L)) of the
output projections, torch's kaiming-uniform for ``nn.Linear``/``nn.Conv*`` weights and biases,
N(0, 1) for ``nn.Embedding``, log U(A_init_range) for GDN's ``A_log``. Parameters built without
randomness (norm weights, GDN's ``dt_bias``, zero biases) are already the same in every layout and
are left as built. A parameter no rule covers stops the run at start-up, naming it.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import torch

# elements per generated block: bounds what a rank holds beside its weights while it initialises
BLOCK_ELEMENTS = 1 << 24
# the output projections megatron initialises with output_layer_init_method
_OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight", "out_proj.weight")


@dataclass(frozen=True)
class Rule:
    """How one parameter is drawn: ``normal`` (mean 0, std ``a``), ``uniform`` (-a, a),
    ``log_uniform`` (log of U(a, b)) or ``keep`` (its deterministic built value)."""

    kind: str
    a: float = 0.0
    b: float = 0.0


def _std(init_method, what: str) -> float:
    """The std of one of megatron's normal init methods (``init_method_normal`` and its scaled kin
    are ``functools.partial(torch.nn.init.normal_, mean=0, std=...)``)."""
    if isinstance(init_method, functools.partial) and init_method.func is torch.nn.init.normal_ \
            and not init_method.keywords.get("mean", 0.0):
        return float(init_method.keywords["std"])
    raise ValueError(f"model.init=layout_independent reproduces megatron's N(0, std) init methods only; "
                     f"{what} is {init_method!r}: set model.init=megatron")


def _kaiming_bound(weight: torch.Tensor) -> float:
    """torch's default for nn.Linear / nn.Conv*: kaiming_uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in)),
    and the same bound for the bias. A depthwise convolution's fan-in does not change with TP."""
    fan_in = weight.shape[1] * math.prod(weight.shape[2:]) if weight.dim() > 1 else weight.shape[0]
    return 1.0 / math.sqrt(fan_in) if fan_in else 0.0


def rule_of(module: torch.nn.Module, pname: str, name: str, config) -> Rule:
    """The rule of parameter ``pname`` of ``module`` (``name`` in the model); ``config`` is the
    language model's TransformerConfig."""
    kind = type(module).__name__
    if "Norm" in kind or pname == "dt_bias":  # ones / zeros as built, no RNG
        return Rule("keep")
    if pname == "A_log":
        lo, hi = getattr(module, "A_init_range", (1, 16))
        return Rule("log_uniform", float(lo), float(hi))
    if isinstance(module, torch.nn.Embedding):
        return Rule("normal", 1.0)
    if isinstance(module, (torch.nn.Linear, torch.nn.modules.conv._ConvNd)):
        return Rule("uniform", _kaiming_bound(module.weight))
    if config is None:
        raise ValueError(f"{name}: no layout-independent init rule for a {kind} outside a megatron model")
    if pname == "bias":  # megatron's linear biases start at zero
        return Rule("keep")
    if name.endswith(_OUTPUT_PROJECTIONS):
        return Rule("normal", _std(config.output_layer_init_method, "output_layer_init_method"))
    if name.endswith("word_embeddings.weight"):
        return Rule("normal", _std(config.embedding_init_method or config.init_method, "embedding_init_method"))
    if pname in ("weight", "gate_weight"):
        return Rule("normal", _std(config.init_method, "init_method"))
    raise ValueError(f"{name}: no layout-independent init rule for parameter {pname!r} of a {kind}; "
                     f"add one in models/common/layout_init.py or set model.init=megatron")


def rules(model) -> dict[str, Rule]:
    """Every parameter's rule, by its name in ``model``."""
    config = getattr(model, "config", None)
    out = {}
    for mname, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            out[name] = rule_of(module, pname, name, config)
    return out


def _block_seed(seed: int, key: str, first_row: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{key}/{first_row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _sample(rule: Rule, shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
    if rule.kind == "normal":
        return torch.randn(shape, generator=gen, device=device).mul_(rule.a)
    out = torch.rand(shape, generator=gen, device=device)
    if rule.kind == "uniform":
        return out.mul_(2 * rule.a).sub_(rule.a)
    if rule.kind == "log_uniform":
        return out.mul_(rule.b - rule.a).add_(rule.a).log_()
    raise ValueError(rule.kind)


def fill_piece(data: torch.Tensor, key: str, global_offset, global_shape, rule: Rule, seed: int) -> None:
    """Write into ``data`` (a piece at ``global_offset`` of global tensor ``key``) its values."""
    gshape = tuple(global_shape) or (1,)
    offset = tuple(global_offset) or (0,)
    local = data.view(1) if data.dim() == 0 else data
    row = math.prod(gshape[1:])
    per_block = max(1, BLOCK_ELEMENTS // max(row, 1))
    first, last = offset[0], offset[0] + local.shape[0]
    inner = (slice(None), *(slice(o, o + s) for o, s in zip(offset[1:], local.shape[1:])))
    for b0 in range(first - first % per_block, last, per_block):
        b1 = min(b0 + per_block, gshape[0])
        gen = torch.Generator(device=data.device).manual_seed(_block_seed(seed, key, b0))
        block = _sample(rule, (b1 - b0, *gshape[1:]), gen, data.device)
        lo, hi = max(b0, first), min(b1, last)
        local[lo - first:hi - first].copy_(block[lo - b0:hi - b0][inner])


def pieces_of(name: str, entry) -> list:
    """The ShardedTensors a sharded-state-dict entry stores: a factory (GDN's sectioned ``in_proj``,
    fc1's gate/up halves) built into its pieces, each a view of the parameter; refused in one line
    when a piece is not a plain slice of its global tensor."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(entry, ShardedTensorFactory):
        built = entry.build()
        pieces = list(built.values()) if isinstance(built, dict) else list(built)
    else:
        pieces = [entry]
    for st in pieces:
        if not isinstance(st, ShardedTensor) or st.flattened_range is not None:
            raise ValueError(f"{name}: a piece that is not a plain slice of its global tensor ({type(st).__name__})")
    return pieces


def sharded_pieces(model):
    """(parameter name, ShardedTensor) for every piece of every parameter ``model`` holds."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    params = dict(model.named_parameters())
    for name, entry in model.sharded_state_dict().items():
        if isinstance(entry, ShardedObject) or name not in params:
            continue
        for st in pieces_of(name, entry):
            yield name, st


@torch.no_grad()
def init_layout_independent(model, seed: int) -> dict:
    """Overwrite ``model``'s (this rank's part of the model) random weights with the layout-
    independent ones of ``seed``. Call it after the model is built, before LoRA, freezing and DDP.
    Returns counts for the log."""
    by_name = rules(model)
    params = dict(model.named_parameters())
    covered = dict.fromkeys(params, 0)
    done = {"tensors": 0, "kept": 0}
    for name, st in sharded_pieces(model):
        rule = by_name[name]
        if st.key.endswith("word_embeddings.weight") and rule.kind == "normal":
            # the last stage's tied output layer is stored under the embedding's key: one tensor, one rule
            rule = Rule("normal", _std(model.config.embedding_init_method or model.config.init_method,
                                       "embedding_init_method"))
        p = params[name]
        if st.data.data_ptr() < p.data_ptr() or st.data.data_ptr() >= p.data_ptr() + p.numel() * p.element_size():
            raise ValueError(f"{name}: its sharded piece {st.key} is not a view of the parameter")
        covered[name] += st.data.numel()
        if rule.kind != "keep":
            # a model whose layers are all alike stacks them on prepended axes (megatron's layer
            # index): each index is a tensor of its own, named by the key and that index
            k = st.prepend_axis_num
            key = st.key + "".join(f"/{i}" for i in st.global_offset[:k])
            fill_piece(st.data, key, st.global_offset[k:], st.global_shape[k:], rule, seed)
    missing = [n for n, k in covered.items() if k != params[n].numel() and by_name[n].kind != "keep"]
    if missing:
        raise ValueError(f"{missing[0]}: the sharded state dict does not cover this parameter exactly "
                         f"({covered[missing[0]]} of {params[missing[0]].numel()} elements); set model.init=megatron")
    for name, rule in by_name.items():
        done["kept" if rule.kind == "keep" else "tensors"] += 1
    return done
