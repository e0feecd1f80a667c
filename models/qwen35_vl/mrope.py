"""Qwen3.5's MRoPE position ids (host side, in the data pipeline).

The rotation itself (angles per frequency axis, rotate-half) is in fused_kernels/rotary.py, beside its
fused kernel (fused_kernels/fused_mrope.py).

Position ids (``mrope_position_ids``) follow transformers' ``get_rope_index`` for
Qwen3.5: text advances by one per token; an image of merged grid (t, h, w) placed at
position p gets (p + t_idx, p + h_idx, p + w_idx), and the text after it continues at
p + max(h, w). A video is split into its temporal groups first (``split_video_grids``): its
groups are separated by timestamp text in the prompt, and each is placed like an image of t = 1.
"""

from __future__ import annotations

import torch


def mrope_position_ids(
    input_ids: list[int] | torch.Tensor,
    image_grid_thw: list[tuple[int, int, int]] | torch.Tensor,
    image_token_id: int | tuple[int, ...],
    spatial_merge_size: int,
) -> torch.Tensor:
    """3-D position ids [3, L] for one sample (host side, in the data pipeline).

    Consecutive tokens of one vision id (``image_token_id``: one id or several, e.g. image and
    video) form one image; images consume ``image_grid_thw`` in order (videos as
    ``split_video_grids`` gives them). Raises if the number of image tokens does not match the grids.
    """
    vision_ids = set(image_token_id) if isinstance(image_token_id, (tuple, list, set)) else {image_token_id}
    ids = torch.as_tensor(input_ids).tolist()
    grids = [tuple(int(x) for x in g) for g in torch.as_tensor(image_grid_thw).reshape(-1, 3).tolist()]
    out = torch.empty(3, len(ids), dtype=torch.long)
    pos, i, img = 0, 0, 0
    while i < len(ids):
        if ids[i] not in vision_ids:
            out[:, i] = pos
            pos += 1
            i += 1
            continue
        if img >= len(grids):
            raise ValueError(f"image token at index {i} but only {len(grids)} image grid(s) given")
        t, h, w = grids[img]
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        n = t * gh * gw
        if ids[i : i + n] != [ids[i]] * n:
            raise ValueError(f"image {img} needs {n} consecutive image tokens at index {i}")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        out[0, i : i + n] = tt.flatten() + pos
        out[1, i : i + n] = hh.flatten() + pos
        out[2, i : i + n] = ww.flatten() + pos
        pos += max(gh, gw)
        i += n
        img += 1
    if img != len(grids):
        raise ValueError(f"{len(grids)} image grid(s) given but only {img} image(s) found in the tokens")
    return out


def split_video_grids(video_grid_thw: torch.Tensor) -> torch.Tensor:
    """Each video grid (t, h, w) as t grids (1, h, w), one per temporal group, as get_rope_index does."""
    g = torch.as_tensor(video_grid_thw).reshape(-1, 3)
    out = g.repeat_interleave(g[:, 0], dim=0)
    out[:, 0] = 1
    return out
