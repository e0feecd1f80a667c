"""Synthetic image+text conversations with a signal the model can actually learn.

Each image shows one of ``num_classes`` classes, drawn as a class-specific colour plus
stripes of a class-specific period and orientation (with a little per-sample noise), and the
assistant answers with a fixed token span per class, image by image. The answer is therefore
predictable only by looking at the images, so a falling loss on the masked answer tokens
shows that pixels -> vision tower -> merger -> language model all carry gradient and signal.
The prompt text is Zipf-distributed filler with repeated spans (so the LM part has ordinary,
partly copyable statistics) and is never trained on. With ``data.mock.reply_text_tokens`` set,
each reply also carries that much filler of the same kind after the class answers, and it is
trained on: a language-modelling load with many supervised tokens per sample.

Conversation layout (one sample)::

    <im_start> USER (<vision_start> <image_pad>*k <vision_end>)*n prompt... <im_end>
    <im_start> ASSISTANT answer(c_1) ... answer(c_n) [reply text...] <im_end>

Every sample is a pure function of (data.seed, index): ``numpy.random.default_rng((seed, index))``.
The class styles and answer spans depend on the class only (they define the task), not on
the seed.
"""

from __future__ import annotations

import numpy as np
import torch

from models import get_model_family
from models.common.vision_patches import patchify

_TASK_SEED = 0x5EED  # fixed: class styles and answer spans are the task, shared across seeds


class MockDataset(torch.utils.data.Dataset):
    """Deterministic synthetic multimodal samples; see the module docstring for the layout."""

    def __init__(self, model_cfg, data_cfg, seq_length: int):
        v = model_cfg.vision
        self.m, self.d, self.seq_length = model_cfg, data_cfg, seq_length
        self.patch, self.tp, self.merge = v.patch_size, v.temporal_patch_size, v.spatial_merge_size
        self.position_ids = get_model_family(model_cfg.name).position_ids  # e.g. MRoPE's 3-D ids
        self.unit = self.patch * self.merge
        self.image_mean, self.image_std = tuple(data_cfg.image_mean), tuple(data_cfg.image_std)
        if data_cfg.mock.min_image_side % self.unit or data_cfg.mock.max_image_side % self.unit:
            raise ValueError(f"data.mock.min_image_side/max_image_side must be multiples of {self.unit}")
        # Ordinary text ids lie below every special token; the two just below them are the
        # role headers (real tokenizers put their special ids at the top of the vocabulary).
        m = model_cfg
        lowest_special = min(m.image_token_id, m.video_token_id, m.vision_start_token_id, m.vision_end_token_id,
                             m.im_start_token_id, m.im_end_token_id, m.eos_token_id, m.pad_token_id)
        self.user_id, self.assistant_id = lowest_special - 2, lowest_special - 1
        self.text_vocab = lowest_special - 2
        if self.text_vocab < 16:
            raise ValueError(f"special token ids from {lowest_special} up leave too few text ids for mock data")
        task = np.random.default_rng(_TASK_SEED)
        n = data_cfg.mock.num_classes
        self.colours = task.uniform(0.1, 0.9, size=(n, 3)).astype(np.float32)
        self.periods = task.choice([4, 6, 8, 10, 12, 16], size=n)
        self.angles = task.uniform(0, np.pi, size=n)
        self.answers = [task.integers(0, self.text_vocab, size=4 + c % 5).tolist() for c in range(n)]

    def __len__(self) -> int:
        return self.d.mock.num_samples

    # ------------------------------------------------------------------ pieces

    def _image(self, rng: np.random.Generator, c: int, h: int, w: int) -> torch.Tensor:
        """Class colour + oriented stripes (period in pixels, so every patch sees them) + noise."""
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        phase = rng.uniform(0, 2 * np.pi)
        proj = xx * np.cos(self.angles[c]) + yy * np.sin(self.angles[c])
        stripes = np.sin(2 * np.pi * proj / self.periods[c] + phase).astype(np.float32)
        img = self.colours[c][:, None, None] + 0.25 * stripes[None] + rng.normal(0, 0.03, (3, h, w))
        return torch.from_numpy(np.clip(img, 0.0, 1.0).astype(np.float32))

    def _text(self, rng: np.random.Generator, n: int) -> list[int]:
        """Zipf(1.2) ids (folded into the text vocab) with occasional copies of earlier spans."""
        out: list[int] = []
        while len(out) < n:
            span = int(rng.integers(4, 17))
            if len(out) >= 8 and rng.random() < 0.25:
                start = int(rng.integers(0, len(out) - 4))
                out += out[start : start + span]
            else:
                out += ((rng.zipf(1.2, size=span) - 1) % self.text_vocab).tolist()
        return out[:n]

    # ------------------------------------------------------------------ sample

    def __getitem__(self, index: int) -> dict:
        m, g = self.m, self.d.mock
        rng = np.random.default_rng((self.d.seed, int(index)))
        n_img = int(rng.integers(g.min_images, g.max_images + 1))
        classes = rng.integers(0, g.num_classes, size=n_img).tolist()
        lo, hi = g.min_image_side // self.unit, g.max_image_side // self.unit
        sides = (rng.integers(lo, hi + 1, size=(n_img, 2)) * self.unit).tolist()

        pixels, grids, image_spans = [], [], []
        for c, (h, w) in zip(classes, sides):
            pv, thw = patchify(self._image(rng, c, h, w), self.patch, self.tp, self.merge,
                                   self.image_mean, self.image_std)
            pixels.append(pv)
            grids.append(thw)
            k = int(thw.prod()) // self.merge**2
            image_spans += [m.vision_start_token_id] + [m.image_token_id] * k + [m.vision_end_token_id]
        answer = [t for c in classes for t in self.answers[c]]
        if g.reply_text_tokens:  # its own generator: the sample's other draws stay as without it
            answer += self._text(np.random.default_rng((self.d.seed, int(index), 1)), g.reply_text_tokens)

        # Fixed part: 2 headers (im_start + role) x 2 turns, 2 im_end, images, answer.
        fixed = 6 + len(image_spans) + len(answer)
        if fixed > self.seq_length:
            raise ValueError(
                f"mock sample {index}: {n_img} image(s) of sizes {sides} (HxW) need {fixed} tokens "
                f"without any prompt text, more than train.seq_length={self.seq_length}; raise "
                "train.seq_length or lower data.mock.max_image_side / data.mock.max_images / data.mock.reply_text_tokens"
            )
        n_text = int(rng.integers(g.min_text_tokens, g.max_text_tokens + 1))
        n_text = min(n_text, self.seq_length - fixed)  # shrink the prompt to fit
        prompt = self._text(rng, n_text)

        user = [m.im_start_token_id, self.user_id] + image_spans + prompt + [m.im_end_token_id]
        reply_start = len(user) + 2  # first answer token
        ids = user + [m.im_start_token_id, self.assistant_id] + answer + [m.im_end_token_id]
        input_ids = torch.tensor(ids, dtype=torch.long)

        labels = torch.full_like(input_ids, -100)
        labels[:-1] = input_ids[1:]
        # Train where the *label* is an answer token or the im_end closing the reply:
        # label positions t with t+1 in [reply_start, len(ids)-1].
        loss_mask = torch.zeros(len(ids), dtype=torch.float32)
        loss_mask[reply_start - 1 : len(ids) - 1] = 1.0

        grid_thw = torch.stack(grids)
        return {
            "input_ids": input_ids,
            "labels": labels,
            "loss_mask": loss_mask,
            "position_ids": self.position_ids(input_ids, grid_thw, m.image_token_id, self.merge),
            "pixel_values": torch.cat(pixels),
            "image_grid_thw": grid_thw,
            "index": int(index),
        }
