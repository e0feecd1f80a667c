"""Turn samples into model micro-batches: THD packing (one row, varlen) or BSHD padding.

Both return the same keys, so the training step does not care which layout it gets:
``tokens, labels, loss_mask, position_ids [3, B, S], pixel_values, image_grid_thw,
cu_seqlens, max_seqlen, sample_lengths, num_real_tokens``.

Labels are valid ids everywhere (``-100`` becomes ``pad_id``) because the model computes
cross-entropy on every position; ``loss_mask`` alone decides what is trained. Image-token
counts are checked against the grids here, since a mismatch would otherwise surface as an
opaque shape error deep inside the vision/LM merge.
"""

from __future__ import annotations

import torch

from core.vision_tokens import vision_token_mask


def _check_images(sample: dict, image_token_id: int | tuple[int, ...], merge: int) -> None:
    grids = sample["image_grid_thw"].reshape(-1, 3)
    want = int((grids.prod(dim=1) // merge**2).sum())
    got = int(vision_token_mask(sample["input_ids"], image_token_id).sum())
    if got != want:
        raise ValueError(
            f"sample {sample.get('index')}: {got} image tokens but its image_grid_thw "
            f"{grids.tolist()} needs {want} (sum of t*h*w/{merge}^2)"
        )
    rows = int(grids.prod(dim=1).sum())
    if sample["pixel_values"].shape[0] != rows:
        raise ValueError(
            f"sample {sample.get('index')}: pixel_values has {sample['pixel_values'].shape[0]} "
            f"patch rows but image_grid_thw {grids.tolist()} needs {rows}"
        )


def _images(samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    pv = [s["pixel_values"] for s in samples if s["pixel_values"].numel()]
    grids = [s["image_grid_thw"].reshape(-1, 3) for s in samples]
    dim = samples[0]["pixel_values"].shape[-1] if samples[0]["pixel_values"].dim() == 2 else 0
    pixel_values = torch.cat(pv) if pv else torch.zeros(0, dim, dtype=torch.float32)
    return pixel_values, torch.cat(grids).to(torch.long)


def _valid_labels(labels: torch.Tensor, loss_mask: torch.Tensor, pad_id: int):
    ignore = labels < 0
    return labels.masked_fill(ignore, pad_id), loss_mask.masked_fill(ignore, 0.0)


def _validate(samples: list[dict], seq_length: int, image_token_id: int, merge: int) -> None:
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    for s in samples:
        _check_images(s, image_token_id, merge)
        if len(s["input_ids"]) > seq_length:
            raise ValueError(
                f"sample {s.get('index')} has {len(s['input_ids'])} tokens, more than "
                f"seq_length={seq_length}; raise train.seq_length or shorten the sample"
            )


def padded_length(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _padding_mask(seq_length: int, segments: list[int], real: list[int]) -> torch.Tensor:
    """True on padding tokens (MoE routing and its aux losses skip them); the tail segment is all padding."""
    mask = torch.ones(seq_length, dtype=torch.bool)
    start = 0
    for n_segment, n_real in zip(segments, real):
        mask[start:start + n_real] = False
        start += n_segment
    return mask


def pack_thd(samples: list[dict], seq_length: int, pad_id: int, image_token_id: int, merge: int,
             pad_multiple: int = 1) -> dict:
    """Concatenate samples into one row of exactly ``seq_length`` tokens (B=1).

    Each sample is one varlen segment, so attention and the GDN recurrence never cross
    samples; positions restart at every sample. With ``pad_multiple`` > 1 (context
    parallelism needs 2*cp, times tp under sequence parallelism) each sample is padded at its
    end to a multiple of it: the padding belongs to the sample's segment in
    ``cu_seqlens_padded``, comes after its last real token (so causal attention and the GDN
    recurrence of real tokens never read it) and has loss_mask 0. ``cu_seqlens`` holds the
    real lengths. The tail padding, if any, is a final segment of its own.
    """
    _validate(samples, seq_length, image_token_id, merge)
    if seq_length % pad_multiple:
        raise ValueError(f"seq_length={seq_length} must be a multiple of the padding multiple {pad_multiple}")
    lengths = [len(s["input_ids"]) for s in samples]
    padded = [padded_length(n, pad_multiple) for n in lengths]
    total = sum(padded)
    if total > seq_length:
        raise ValueError(
            f"samples {[s.get('index') for s in samples]} have {total} tokens together "
            f"({lengths}, padded to multiples of {pad_multiple}), more than seq_length={seq_length}"
        )
    tokens, labels, loss_mask, positions = [], [], [], []
    for s, n, n_padded in zip(samples, lengths, padded):
        extra = n_padded - n
        tokens += [s["input_ids"], torch.full((extra,), pad_id, dtype=torch.long)]
        labels += [s["labels"], torch.full((extra,), -100, dtype=torch.long)]
        loss_mask += [s["loss_mask"].float(), torch.zeros(extra)]
        after = s["position_ids"].max() + 1 if n else 0  # padding continues past the sample's last position
        positions += [s["position_ids"], (after + torch.arange(extra, dtype=torch.long)).expand(3, extra)]
    n_pad = seq_length - total
    tokens.append(torch.full((n_pad,), pad_id, dtype=torch.long))
    labels.append(torch.full((n_pad,), -100, dtype=torch.long))
    loss_mask.append(torch.zeros(n_pad))
    positions.append(torch.arange(n_pad, dtype=torch.long).expand(3, n_pad))
    labels_t, mask_t = _valid_labels(torch.cat(labels), torch.cat(loss_mask), pad_id)
    segments = padded + ([n_pad] if n_pad else [])
    real = lengths + ([n_pad] if n_pad else [])  # the tail is its own segment in cu_seqlens
    cu_padded = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu_padded[1:] = torch.cumsum(torch.tensor(segments), 0)
    cu_real = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu_real[1:] = torch.cumsum(torch.tensor(real), 0)
    pixel_values, grids = _images(samples)
    return {
        "tokens": torch.cat(tokens)[None],
        "padding_mask": _padding_mask(seq_length, padded, lengths)[None],
        "labels": labels_t[None],
        "loss_mask": mask_t[None],
        "position_ids": torch.cat(positions, dim=1)[:, None],
        "pixel_values": pixel_values,
        "image_grid_thw": grids,  # stays on CPU: the vision tower reads it as Python ints
        # TransformerEngine's convention: cumulative real lengths, and cumulative padded lengths
        # (the segment boundaries in this row: what attention and the GDN state reset at)
        "cu_seqlens": cu_real,
        "cu_seqlens_padded": cu_padded,
        "max_seqlen": max(segments),
        "sample_lengths": lengths,
        "num_real_tokens": sum(lengths),
    }


def pad_bshd(samples: list[dict], seq_length: int, pad_id: int, image_token_id: int, merge: int) -> dict:
    """One row per sample, right-padded to ``seq_length`` (padding: positions 0..n-1, loss_mask 0)."""
    _validate(samples, seq_length, image_token_id, merge)
    b = len(samples)
    tokens = torch.full((b, seq_length), pad_id, dtype=torch.long)
    labels = torch.full((b, seq_length), -100, dtype=torch.long)
    loss_mask = torch.zeros(b, seq_length, dtype=torch.float32)
    position_ids = torch.arange(seq_length, dtype=torch.long).repeat(3, b, 1)
    lengths = []
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        lengths.append(n)
        tokens[i, :n] = s["input_ids"]
        labels[i, :n] = s["labels"]
        loss_mask[i, :n] = s["loss_mask"].float()
        position_ids[:, i, :n] = s["position_ids"]
        position_ids[:, i, n:] = torch.arange(seq_length - n)
    labels, loss_mask = _valid_labels(labels, loss_mask, pad_id)
    pixel_values, grids = _images(samples)
    padding_mask = torch.arange(seq_length)[None, :] >= torch.tensor(lengths)[:, None]
    return {
        "tokens": tokens,
        "padding_mask": padding_mask,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "pixel_values": pixel_values,
        "image_grid_thw": grids,
        "cu_seqlens": None,
        "cu_seqlens_padded": None,
        "max_seqlen": None,
        "sample_lengths": lengths,
        "num_real_tokens": sum(lengths),
    }
