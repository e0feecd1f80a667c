"""What the Gated DeltaNet layers need of the trainer's shared machinery, given through the
family's hooks (models/family.py): their static chunk table under the decoder CUDA graphs
(``graph_row_buffers``) and their checkpoint points for selective recompute
(``mixer_checkpoints``: ``gdn_qkv``, ``gdn_norm_out``)."""

from __future__ import annotations

import contextlib
import sys

import torch

from fused_kernels.gated_delta_rule import FLA_CHUNK_SIZE, GDNVarlen
from models.common.packed_seq import cp_info
from models.family import GraphRowBuffers, MixerCheckpoints
from models.qwen35_vl.gdn import Qwen35GatedDeltaNet


class GDNGraphRows(GraphRowBuffers):
    """The GDN chunk table (``GDNVarlen.chunk_indices``) padded to its largest possible length with
    rows that point at the always-empty segment ``max_samples`` (every kernel masks them out), and,
    when the layers run FlashQLA, its fixed-shape plan (fused_kernels/flash_qla_gdr.StaticPlan).
    Real rows are unchanged, so the numbers are the eager ones."""

    def __init__(self, cu_seqlens: torch.Tensor, seq: int, max_samples: int, one_segment: bool,
                 flash_qla_heads: int | None = None):
        self.max_samples = max_samples
        # sum over samples of ceil(len / chunk) <= seq / chunk + samples
        self.chunks = torch.zeros((seq // FLA_CHUNK_SIZE + max_samples, 2), dtype=torch.int64,
                                  device=cu_seqlens.device)
        self.qla = None
        if flash_qla_heads is not None:
            from fused_kernels.flash_qla_gdr import StaticPlan

            self.qla = StaticPlan(cu_seqlens, self.chunks, seq, flash_qla_heads, one_segment)
        plan = None if self.qla is None else self.qla.plan
        super().__init__({"mixer_varlen": GDNVarlen(cu_seqlens, self.chunks, plan, qla_heads=flash_qla_heads)})

    def refusal(self, params) -> str | None:
        varlen = params.mixer_varlen
        if varlen is None:
            return "no GDN chunk table (the model family's packed_row_extras builds one for packed rows)"
        if varlen.chunk_indices.shape[0] > self.chunks.shape[0]:
            return "a GDN chunk table longer than the static one"
        return None

    def load(self, params) -> None:
        chunks = params.mixer_varlen.chunk_indices
        self.chunks[: chunks.shape[0]].copy_(chunks, non_blocking=True)
        self.chunks[chunks.shape[0]:, 0].fill_(self.max_samples)  # the empty segment: masked out
        self.chunks[chunks.shape[0]:, 1].fill_(0)
        if self.qla is not None:
            self.qla.load()

    @contextlib.contextmanager
    def capturing(self):
        """fla memoises per-tensor metadata (chunk offsets) by object identity; over static buffers
        whose contents change that would bake the warm-up batch's values into the graphs."""
        module = sys.modules.get("fla.utils")
        if module is None:
            yield
            return
        saved = getattr(module, "FLA_DISABLE_TENSOR_CACHE", False)
        module.FLA_DISABLE_TENSOR_CACHE = True
        try:
            yield
        finally:
            module.FLA_DISABLE_TENSOR_CACHE = saved


def graph_row_buffers(layers, cu_seqlens, seq: int, max_samples: int, one_segment: bool) -> GDNGraphRows | None:
    """The chunk table the GDN layers among ``layers`` read under graphs; None without GDN layers."""
    if not any(isinstance(m, Qwen35GatedDeltaNet) for layer in layers for m in layer.modules()):
        return None
    return GDNGraphRows(cu_seqlens, seq, max_samples, one_segment, flash_qla_heads(layers))


def flash_qla_heads(layers) -> int | None:
    """The value heads of the layers' GDN modules when they run FlashQLA, else None (the graphs
    then give FlashQLA a fixed-shape plan, made for one head count)."""
    for layer in layers:
        for module in layer.modules():
            if getattr(module, "kernel_backend", None) == "flash_qla":
                return module.num_v_heads_local_tp
    return None


def mixer_checkpoints(mixer, modules, blocks: MixerCheckpoints) -> int:
    """``gdn_qkv`` (the whole input block: ``in_proj`` + ``prepare``: conv, SiLU, l2-norm, head
    repeat, beta, g) and ``gdn_norm_out`` (the gated RMSNorm before ``out_proj``) as discard-output
    blocks of a GDN layer; 0 for any other mixer."""
    if not isinstance(mixer, Qwen35GatedDeltaNet):
        return 0
    changed = 0
    if "gdn_qkv" in modules:
        _InputBlock(mixer, blocks)
        changed += 1
    if "gdn_norm_out" in modules:
        norm_out = mixer.norm_out
        mixer.norm_out = lambda core, z: blocks.checkpoint(norm_out, core, z)
        changed += 1
    return changed


class _InputBlock:
    """``in_proj`` joins ``prepare``'s checkpoint: while the mixer runs its forward on the path that
    calls ``prepare`` (not under context parallelism), ``in_proj`` hands its input through and
    ``prepare`` projects it inside the block, so neither's output is kept. Instance attributes
    shadow the methods: parameters, state_dict and the class are untouched."""

    def __init__(self, gdn, blocks: MixerCheckpoints):
        self.blocks, self.deferring = blocks, False
        self.forward, self.in_proj, self.prepare = gdn.forward, gdn.in_proj.forward, gdn.prepare
        gdn.forward = self._forward
        gdn.in_proj.forward = self._in_proj
        gdn.prepare = self._prepare

    def _forward(self, hidden_states, *args, packed_seq_params=None, **kwargs):
        self.deferring = self.blocks.active() and cp_info(packed_seq_params) is None
        try:
            return self.forward(hidden_states, *args, packed_seq_params=packed_seq_params, **kwargs)
        finally:
            self.deferring = False

    def _in_proj(self, x, *args, **kwargs):
        if self.deferring:
            return x, None  # prepare receives the norm output and projects inside its checkpoint
        return self.in_proj(x, *args, **kwargs)

    def _prepare(self, hidden, cu_seqlens, varlen=None):
        if not self.deferring:
            return self.prepare(hidden, cu_seqlens, varlen)
        return self.blocks.checkpoint(lambda h: self.prepare(self.in_proj(h)[0], cu_seqlens, varlen), hidden)
