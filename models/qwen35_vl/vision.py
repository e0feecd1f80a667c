"""Qwen3.5 vision encoder: patch embed, learned + 2-D rotary positions, ViT blocks, merger.

Input is what the Qwen image processor emits: ``pixel_values [N_patches, C*tp*p*p]`` with
patches in spatial-merge-block order, and ``image_grid_thw [N_images, 3]`` (patch grid per
image, on the host). Output: ``[N_patches / merge^2, out_hidden]``, one row per image
token of the decoder, in the order the image tokens appear.

The encoder is replicated across tensor-parallel ranks (it is ~2-5% of the FLOPs); every
image attends only to itself through the shared attention backend (packed, non-causal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fused_kernels import fused_mrope
from models.common.attention import attention
from fused_kernels.rotary import apply_rotary
from models.qwen35_vl.vision_geometry import VisionGeometry, vision_geometry


class VisionBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, attn_backend: str):
        super().__init__()
        self.heads, self.head_dim, self.attn_backend = heads, hidden // heads, attn_backend
        self.norm1 = nn.LayerNorm(hidden, eps=1e-6)
        self.norm2 = nn.LayerNorm(hidden, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor, angles: torch.Tensor, geo: VisionGeometry) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv(self.norm1(x)).view(n, 3, self.heads, self.head_dim)
        if isinstance(angles, tuple):  # fused: (position ids [3, N], inv_freq, section), see the encoder
            pos, inv, section = angles
            # q and k rotated in one launch; their gradients and v's come back as one tensor
            q, k, v = fused_mrope.rotary_qkv(qkv, pos, inv, section, False)
        else:  # the reference rotates in fp32 and casts back
            q, k, v = qkv.unbind(1)
            q = apply_rotary(q.float(), angles).to(v.dtype)
            k = apply_rotary(k.float(), angles).to(v.dtype)
        a = attention(
            q, k, v, causal=False, cu_seqlens=geo.cu_seqlens, max_seqlen=geo.max_seqlen,
            backend=self.attn_backend, one_segment=geo.one_segment, static_shape=geo.static_shape,
        )
        x = x + self.proj(a.reshape(n, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class VisionEncoder(nn.Module):
    fused_rotary: bool = False  # set by build() from model.fused_mrope

    def __init__(self, cfg, out_hidden: int, attn_backend: str = "auto"):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.merge = cfg.spatial_merge_size
        self.grid_side = cfg.grid_side
        if self.grid_side**2 != cfg.num_position_embeddings:
            raise ValueError("model.vision.num_position_embeddings must be a square number")
        patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
        # A conv3d with stride == kernel over one patch is a linear layer on the flat patch.
        self.patch_embed = nn.Linear(patch_dim, h)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, h)
        head_dim = h // cfg.num_heads
        quarter = head_dim // 2
        self.register_buffer(
            "inv_freq",
            1.0 / (cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter)),
            persistent=False,
        )
        self.blocks = nn.ModuleList(
            VisionBlock(h, cfg.num_heads, cfg.intermediate_size, attn_backend) for _ in range(cfg.depth)
        )
        merged = h * self.merge**2
        self.merger_norm = nn.LayerNorm(h, eps=1e-6)
        self.merger_fc1 = nn.Linear(merged, merged)
        self.merger_fc2 = nn.Linear(merged, out_hidden)

    @staticmethod
    def parameter_group(name: str) -> str:
        """``merger`` for the patch merger's weights, ``vision`` for the rest (patch and position
        embeddings, blocks): the two model.freeze groups of the encoder."""
        return "merger" if name.startswith("merger") else "vision"

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        geo = vision_geometry(image_grid_thw, self.merge, self.grid_side, pixel_values.device)
        x = self.embed_patches(pixel_values)
        pos = (self.pos_embed(geo.interp_index) * geo.interp_weight[..., None].to(x.dtype)).sum(1)
        x = x + pos
        freqs = geo.rot_pos.float()[..., None] * self.inv_freq  # [N, 2, quarter/2]
        half = freqs.flatten(1)  # (h freqs, w freqs)
        angles = torch.cat([half, half], -1)[:, None, :]  # [N, 1, head_dim]
        if self.fused_rotary:
            reason = fused_mrope.available(x, "thd")
            if reason is None:
                # the same 2-D rotary as blocked MRoPE: frequencies [0, n) read the row, [n, 2n) the
                # column (axis 0 is unused), with inv_freq repeated for the two halves
                n = self.inv_freq.numel()
                # stack, not rot_pos.T[[0, 0, 1]]: a list index is a host tensor, copied to the
                # device from pageable memory, which waits for all queued work every step
                rows, cols = geo.rot_pos.unbind(1)
                pos = torch.stack([rows, rows, cols])  # [3, N]: (unused, row, col)
                angles = (pos, torch.cat([self.inv_freq, self.inv_freq]), (0, n, n))
            else:
                fused_mrope.warn_fallback(reason)
        return self.blocks_and_merger(x, angles, geo)

    def embed_patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))

    def install_cuda_graphs(self, bucket: int, max_buckets: int, max_images: int, graph_factory=None,
                            grads_to_main_grad: bool = False, warmup_patches: int = 0):
        """Replay blocks_and_merger as CUDA graphs per patch-count bucket (train.cuda_graphs)."""
        from models.qwen35_vl import vision_graphs  # noqa: PLC0415 - only when graphs are asked for

        return vision_graphs.graph_vision_encoder(self, bucket, max_buckets, max_images, graph_factory, grads_to_main_grad,
                                     warmup_patches)

    def blocks_and_merger(self, x: torch.Tensor, angles, geo: VisionGeometry) -> torch.Tensor:
        """The ViT blocks and the patch merger: [N_patches, hidden] -> [N_patches / merge^2, out].
        Reads only ``geo.cu_seqlens`` and ``geo.max_seqlen`` (vision_graphs replays it as a graph)."""
        for blk in self.blocks:
            x = blk(x, angles, geo)
        x = self.merger_norm(x).view(-1, self.merger_fc1.in_features)
        return self.merger_fc2(F.gelu(self.merger_fc1(x)))
