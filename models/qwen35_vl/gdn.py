"""Gated DeltaNet layer: megatron-core's parameters, our forward.

We keep megatron-core's ``GatedDeltaNet`` for construction, initialisation and sharded
checkpointing (fused ``in_proj`` = [q, k, v, z, beta, alpha] per TP rank, ``conv1d``,
``A_log``, ``dt_bias``, ``out_norm``, ``out_proj``) and replace its forward because
megatron's forward needs flash-linear-attention's Triton kernels for packed batches,
which do not exist on CPU. Ours dispatches every op through ``kernels.gated_delta_rule``
(fla on GPU, PyTorch references elsewhere), so the same layer trains on CPU and GPU.

Numerics follow transformers' ``Qwen3_5GatedDeltaNet``: SiLU(conv1d) over q|k|v,
l2-normalised q and k, q/k heads repeated for grouped value heads, beta = sigmoid(b),
g = -exp(A_log) * softplus(a + dt_bias), gated RMSNorm, output projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.ssm.gated_delta_net import GatedDeltaNet

from kernels import gated_delta_rule as gdr


class Qwen35GatedDeltaNet(GatedDeltaNet):
    gdn_backend_request: str = "auto"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.cp_size > 1:
            raise NotImplementedError(
                "Gated DeltaNet under context parallelism is not implemented yet; set parallel.cp=1"
            )
        self.kernel_backend = gdr.gdn_backend(self.gdn_backend_request)

    def forward(self, hidden_states, attention_mask=None, inference_context=None, packed_seq_params=None,
                sequence_len_offset=None, **kwargs):
        cu_seqlens = None
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu_seqlens = packed_seq_params.cu_seqlens_q_padded
            if cu_seqlens is None:
                cu_seqlens = packed_seq_params.cu_seqlens_q

        proj, _ = self.in_proj(hidden_states)  # [S, B, D_local] (S gathered under SP)
        q, k, v, g, beta, z = self.prepare(proj, cu_seqlens)
        core = gdr.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, self.kernel_backend)  # [B, S, nv, V]
        return self.out_proj(self.norm_out(core, z))

    def prepare(self, proj: torch.Tensor, cu_seqlens: torch.Tensor | None):
        """in_proj output [S, B, D_local] -> delta-rule inputs (q, k, v, g, beta) and the gate z.

        q, k [B, S, nv, K] (l2-normed, repeated to the value heads), v and z [B, S, nv, V],
        g (log-space decay, fp32) and beta [B, S, nv].
        """
        proj = proj.transpose(0, 1)  # [B, S, D_local]
        batch, seq = proj.shape[:2]
        qk, vd = self.qk_dim_local_tp, self.v_dim_local_tp
        nv = self.num_v_heads_local_tp
        qkv, z, b, a = torch.split(proj, [2 * qk + vd, vd, nv, nv], dim=-1)

        qkv = gdr.causal_conv1d_silu(qkv, self.conv1d.weight.squeeze(1), cu_seqlens, self.kernel_backend)
        q, k, v = torch.split(qkv, [qk, qk, vd], dim=-1)
        q = gdr.l2norm(q.reshape(batch, seq, -1, self.key_head_dim))
        k = gdr.l2norm(k.reshape(batch, seq, -1, self.key_head_dim))
        v = v.reshape(batch, seq, nv, self.value_head_dim)
        if nv != q.shape[2]:
            rep = nv // q.shape[2]
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)

        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        z = z.reshape(batch, seq, nv, self.value_head_dim)
        return q.contiguous(), k.contiguous(), v.contiguous(), g, beta, z

    def norm_out(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm of the delta-rule output [B, S, nv, V] -> [S, B, nv*V] for out_proj."""
        out = self.out_norm(core, z)
        batch, seq = out.shape[:2]
        return out.reshape(batch, seq, -1).transpose(0, 1).contiguous()
