"""Gated DeltaNet layer: megatron-core's parameters, our forward.

We keep megatron-core's ``GatedDeltaNet`` for construction, initialisation and sharded
checkpointing (fused ``in_proj`` = [q, k, v, z, beta, alpha] per TP rank, ``conv1d``,
``A_log``, ``dt_bias``, ``out_norm``, ``out_proj``) and replace its forward because
megatron's forward needs flash-linear-attention's Triton kernels for packed batches,
which do not exist on CPU. Ours dispatches every op through ``fused_kernels.gated_delta_rule``
(fla on GPU, PyTorch references elsewhere), so the same layer trains on CPU and GPU.

Numerics follow transformers' ``Qwen3_5GatedDeltaNet``: SiLU(conv1d) over q|k|v,
l2-normalised q and k, q/k heads repeated for grouped value heads, beta = sigmoid(b),
g = -exp(A_log) * softplus(a + dt_bias), gated RMSNorm, output projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.ssm.gated_delta_net import GatedDeltaNet

from fused_kernels import fused_pre_gdr
from fused_kernels import gated_delta_rule as gdr
from models.common.packed_seq import cp_info, segment_boundaries
from models.common.cp_collectives import heads_to_tokens, tokens_to_heads


class Qwen35GatedDeltaNet(GatedDeltaNet):
    gdn_backend_request: str = "auto"
    # model.gdn_pre_impl as build() resolved it: "fused" (fused_kernels/fused_pre_gdr.py) or "unfused"
    gdn_pre_impl: str = "unfused"
    save_states: bool = True  # model.gdn_save_states (fla only)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # with flash_qla, FlashQLA's split is planned on the host from the micro-batch's
        # boundaries at the first GDN call (GDNVarlen.flash_qla_plan); the graphs hold a fixed plan
        self.kernel_backend = gdr.gdn_backend(self.gdn_backend_request)

    def forward(self, hidden_states, attention_mask=None, inference_context=None, packed_seq_params=None,
                sequence_len_offset=None, **kwargs):
        cu_seqlens, varlen = None, None
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu_seqlens = segment_boundaries(packed_seq_params)
            varlen = getattr(packed_seq_params, "mixer_varlen", None)  # built once per micro-batch (packed_row_extras)

        proj, _ = self.in_proj(hidden_states)  # [S, B, D_local] (S gathered under SP)
        cp = cp_info(packed_seq_params)
        if cp is not None:
            core, z = self._context_parallel_core(proj, cp, cu_seqlens, varlen)
        else:
            q, k, v, g, beta, z = self.prepare(proj, cu_seqlens, varlen)
            core = gdr.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, self.kernel_backend, varlen,
                                              self.save_states)  # [B, S, nv, V]
        return self.out_proj(self.norm_out(core, z))

    def _split_proj(self, proj: torch.Tensor):
        """in_proj output [S, B, D_local] -> q, k, v (conv channels), z, b, a along the last dim."""
        qk, vd, nv = self.qk_dim_local_tp, self.v_dim_local_tp, self.num_v_heads_local_tp
        return torch.split(proj, [qk, qk, vd, vd, nv, nv], dim=-1)

    def prepare(self, proj: torch.Tensor, cu_seqlens: torch.Tensor | None, varlen=None):
        """in_proj output [S, B, D_local] -> delta-rule inputs (q, k, v, g, beta) and the gate z.

        q, k [B, S, nv, K] (l2-normed, repeated to the value heads), v and z [B, S, nv, V],
        g (log-space decay, fp32) and beta [B, S, nv].
        """
        if self._use_fused_pre(proj):
            return self._prepare_fused(proj, cu_seqlens)
        q, k, v, z, b, a = (t.transpose(0, 1) for t in self._split_proj(proj))  # [B, S, ...]
        qkv = torch.cat([q, k, v], dim=-1)
        out = self.prepare_heads(qkv, b, a, self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias, cu_seqlens,
                                 varlen)
        batch, seq = z.shape[:2]
        return (*out, z.reshape(batch, seq, -1, self.value_head_dim))

    def prepare_heads(self, qkv, b, a, conv_weight, A_log, dt_bias, cu_seqlens, varlen=None):
        """The pre-delta-rule chain for any contiguous group of heads: qkv [B, S, 2*nk*K + nv*V]
        (q | k | v channels), b, a [B, S, nv]; conv_weight [channels, width]; A_log, dt_bias [nv].
        Returns q, k [B, S, nv, K], v [B, S, nv, V], g (fp32), beta [B, S, nv]."""
        batch, seq = qkv.shape[:2]
        nv = b.shape[-1]
        nk = (qkv.shape[-1] - nv * self.value_head_dim) // (2 * self.key_head_dim)
        if self.gdn_pre_impl == "fused":
            reason = fused_pre_gdr.available(qkv, conv_weight, nk, nv)
            if reason is None:
                return fused_pre_gdr.fused_pre_gdr(qkv, b, a, conv_weight, A_log, dt_bias, cu_seqlens, nk,
                                                   self.key_head_dim, self.value_head_dim)
            fused_pre_gdr.warn_fallback(reason)
        qkv = gdr.causal_conv1d_silu(qkv, conv_weight, cu_seqlens, self.kernel_backend, varlen)
        q, k, v = torch.split(qkv, [nk * self.key_head_dim, nk * self.key_head_dim, nv * self.value_head_dim], dim=-1)
        q = gdr.l2norm(q.reshape(batch, seq, nk, self.key_head_dim))
        k = gdr.l2norm(k.reshape(batch, seq, nk, self.key_head_dim))
        v = v.reshape(batch, seq, nv, self.value_head_dim)
        if nv != nk:
            q, k = q.repeat_interleave(nv // nk, dim=2), k.repeat_interleave(nv // nk, dim=2)
        beta = b.sigmoid()
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
        return q.contiguous(), k.contiguous(), v.contiguous(), g, beta

    def _context_parallel_core(self, proj: torch.Tensor, cp, cu_seqlens, varlen=None):
        """Head-parallel GDN (models/common/cp_collectives.py): rank r runs the conv and the delta
        rule over the whole sequence for its 1/cp of the key and value heads, then the outputs go
        back to the local tokens. The gate z never leaves its rank."""
        n = cp.cp_size
        q, k, v, z, b, a = self._split_proj(proj)  # [S_local, B, ...]
        seq_local, batch = proj.shape[:2]
        grouped = [t.reshape(seq_local, batch, n, -1) for t in (q, k, v, b, a)]  # head groups on dim 2
        widths = [t.shape[-1] for t in grouped]
        full = tokens_to_heads(torch.cat(grouped, dim=-1), cp)  # [S, B, sum(widths)]
        qg, kg, vg, bg, ag = (t.transpose(0, 1) for t in torch.split(full, widths, dim=-1))  # [B, S, ...]
        r = cp.cp_rank
        weight = self.conv1d.weight.squeeze(1)
        w_q, w_k, w_v = torch.split(weight, [self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp])
        conv_weight = torch.cat([w.reshape(n, -1, w.shape[-1])[r] for w in (w_q, w_k, w_v)])
        nv = self.num_v_heads_local_tp // n
        heads = slice(r * nv, (r + 1) * nv)
        qh, kh, vh, g, beta = self.prepare_heads(
            torch.cat([qg, kg, vg], dim=-1), bg, ag, conv_weight, self.A_log[heads], self.dt_bias[heads], cu_seqlens,
            varlen,
        )
        core = gdr.chunk_gated_delta_rule(qh, kh, vh, g, beta, cu_seqlens, self.kernel_backend, varlen,
                                          self.save_states)  # [B, S, nv/cp, V]
        core = heads_to_tokens(core.transpose(0, 1), cp)  # [S_local, B, cp, nv/cp, V]
        core = core.reshape(seq_local, batch, -1, self.value_head_dim).transpose(0, 1)
        return core, z.transpose(0, 1).reshape(batch, seq_local, -1, self.value_head_dim)

    def _use_fused_pre(self, proj: torch.Tensor) -> bool:
        if self.gdn_pre_impl != "fused":
            return False
        nk = self.qk_dim_local_tp // self.key_head_dim
        reason = fused_pre_gdr.available(proj, self.conv1d.weight, nk, self.num_v_heads_local_tp)
        if reason is not None:
            fused_pre_gdr.warn_fallback(reason)
        return reason is None

    def _prepare_fused(self, proj: torch.Tensor, cu_seqlens: torch.Tensor | None):
        """prepare() in one Triton kernel each way. The kernels read q|k|v, b and a in place through
        the [B, S, D] view of in_proj's output (no copy before them), and the Function takes that
        whole view, so its backward writes proj's gradient as one tensor (no cat of dqkv, dz, db,
        da after it). z comes back as a view of proj."""
        nv = self.num_v_heads_local_tp
        q, k, v, g, beta, z = fused_pre_gdr.fused_pre_gdr_from_proj(
            proj.transpose(0, 1), self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias, cu_seqlens,
            self.qk_dim_local_tp // self.key_head_dim, self.key_head_dim, self.value_head_dim, nv,
        )
        return q, k, v, g, beta, z.reshape(*z.shape[:2], nv, self.value_head_dim)

    def norm_out(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm of the delta-rule output [B, S, nv, V] -> [S, B, nv*V] for out_proj."""
        out = self.out_norm(core, z)
        batch, seq = out.shape[:2]
        return out.reshape(batch, seq, -1).transpose(0, 1).contiguous()
