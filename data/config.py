"""The recipe's ``data`` section: what every data set reads at the top, one sub-section per kind of
data set (``mock``, ``cord_v2``, ``conversations``), ``video`` for the video parts of
conversations and ``loader`` for how rows are built and fed to the trainer.

Typed dataclasses with defaults; each section checks its own fields (``validate``, one
``ConfigError`` line naming the field and the fix). multimodal/config.py composes the section into
the recipe and checks what spans sections (the model's patch size against image sides, the
validation data against ``train.eval_interval``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from core.errors import ConfigError
from data.energon_config import EnergonConfig
from data.registry import check_dataset_name


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def conversations_path(path: str | None) -> bool:
    """A .json / .jsonl file or a folder (datasets' arrow / parquet, or JSON files): data/record_sources.py."""
    return bool(path) and (Path(path).is_dir() or (Path(path).suffix in (".json", ".jsonl") and Path(path).is_file()))


@dataclass
class MockConfig:
    """The synthetic data set (data/mock.py): generated images and Zipf text, no files."""

    num_samples: int = 100_000  # samples before the generator wraps around
    min_images: int = 1  # images per sample, drawn in [min_images, max_images]
    max_images: int = 3  # images per sample, at most
    min_image_side: int = 32  # pixels; multiples of patch_size * spatial_merge_size
    max_image_side: int = 96  # pixels, the longest side drawn
    min_text_tokens: int = 16  # prompt tokens per sample, drawn in [min_text_tokens, max_text_tokens]
    max_text_tokens: int = 96  # prompt tokens per sample, at most
    num_classes: int = 16  # image classes, each with its own answer
    # Zipf text (like the prompt's) appended to every reply and supervised: a language-modelling
    # load on top of the few class-answer tokens, for loss comparisons that need many supervised
    # tokens per step (0: replies are the class answer alone)
    reply_text_tokens: int = 0

    def validate(self) -> None:
        _require(self.num_samples >= 1, f"data.mock.num_samples must be >= 1, got {self.num_samples}")
        _require(1 <= self.min_images <= self.max_images, "data.mock.min_images must be in [1, data.mock.max_images]")
        _require(1 <= self.min_text_tokens <= self.max_text_tokens,
                 "data.mock.min_text_tokens must be in [1, data.mock.max_text_tokens]")
        _require(self.num_classes >= 1, f"data.mock.num_classes must be >= 1, got {self.num_classes}")
        _require(self.reply_text_tokens >= 0,
                 f"data.mock.reply_text_tokens must be >= 0, got {self.reply_text_tokens}")


@dataclass
class CordV2Config:
    """CORD-v2 receipts (data/cord_v2.py)."""

    prompt: str | None = None  # user prompt beside the receipt image; null: the data set's default
    target_format: str = "json"  # json (gt_parse as JSON, key order kept) | donut (tags)

    def validate(self) -> None:
        _require(self.target_format in ("json", "donut"),
                 f"data.cord_v2.target_format must be json|donut, got {self.target_format!r}")


@dataclass
class ConversationsConfig:
    """Your chat records (data/conversations.py)."""

    # image and video paths are relative to this folder; null: the data file's folder (or the datasets folder)
    image_root: str | None = None
    system_prompt: str | None = None  # put first in records without a system message

    def validate(self) -> None:
        _require(self.image_root is None or Path(self.image_root).is_dir(),
                 f"data.conversations.image_root={self.image_root!r} is not a folder (null: the data file's folder)")


@dataclass
class VideoConfig:
    """Video parts of conversations (data/video.py). Defaults: the released checkpoints'
    video_preprocessor_config.json, which also fills the keys a recipe leaves at these defaults."""

    # frames a second sampled from a file; a list of frames is taken as given at this rate
    fps: float = 2.0
    min_frames: int = 4  # frames kept per video, at least
    max_frames: int = 768  # frames kept per video, at most
    # one size for all frames of a video, with frames * height * width in [min_pixels, max_pixels]
    min_pixels: int = 4096
    max_pixels: int = 25_165_824  # the pixel budget of one video

    def validate(self) -> None:
        _require(self.fps > 0 and 1 <= self.min_frames <= self.max_frames,
                 f"data.video.fps ({self.fps}) must be > 0 and 1 <= data.video.min_frames ({self.min_frames}) "
                 f"<= data.video.max_frames ({self.max_frames})")
        _require(1 <= self.min_pixels <= self.max_pixels,
                 f"data.video.min_pixels ({self.min_pixels}) must be in [1, data.video.max_pixels ({self.max_pixels})]")


@dataclass
class LoaderConfig:
    """How samples become micro-batches (data/loader.py, data/prefetch.py)."""

    # processes that decode/tokenise samples ahead of the trainer (0: in the training process);
    # null: up to 4 per rank on a GPU, 0 on a CPU (data.loader.default_num_workers)
    num_workers: int | None = None
    # micro-batches built ahead in a background thread; null: 2 on GPU, 0 on CPU (where the thread
    # competes with the model for the cores, docs/data.md)
    prefetch: int | None = None
    # packing: rows are filled best-fit from the next this-many samples (the oldest always first,
    # so none waits more than this many rows); 0 packs strictly in order
    pack_lookahead: int = 16
    # pad every packed sample to a multiple of this (null: what the layout needs: 2*cp, times tp
    # under sequence parallelism); set it to compare runs of different layouts on identical rows
    pad_multiple: int | None = None
    max_bad_fraction: float = 0.1  # stop when more of the rows read than this are unusable

    def validate(self) -> None:
        _require(self.num_workers is None or self.num_workers >= 0,
                 "data.loader.num_workers must be >= 0 (0 reads samples in the training process) or null (auto)")
        _require(self.prefetch is None or self.prefetch >= 0,
                 "data.loader.prefetch must be >= 0 (0 disables the background loader thread) or null (auto)")
        _require(self.pack_lookahead >= 0,
                 "data.loader.pack_lookahead must be >= 0 (0 packs samples strictly in order)")
        _require(self.pad_multiple is None or self.pad_multiple >= 1,
                 "data.loader.pad_multiple must be >= 1 or null (auto)")
        _require(0.0 <= self.max_bad_fraction <= 1.0, "data.loader.max_bad_fraction must be in [0, 1]")


@dataclass
class DataConfig:
    name: str = "mock"  # the data set: a name in data.registry.DATASET_REGISTRY
    path: str | None = None  # its files (cord_v2: a folder of parquet files; conversations: a file or folder)
    seed: int = 1234  # the mock generator's draws (each sample a function of seed and index)
    pack: bool = True  # THD packing; false pads each sample to train.seq_length (BSHD)
    tokenizer: str | None = None  # tokenizer dir; the model's special token ids are read from it
    split: str = "train"  # the split of data.path to train on
    # dynamic resolution: each image is resized into this pixel-area range. Defaults: the released
    # checkpoints'; the processor files beside data.tokenizer fill a range left at these defaults
    min_pixels: int = 65_536
    max_pixels: int = 16_777_216  # the largest image area in pixels (min_pixels: the smallest)
    # per-channel normalisation; the processor files beside data.tokenizer fill values left at these defaults
    image_mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    image_std: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])  # per channel, > 0
    # validation data (read when train.eval_interval > 0; multimodal/evaluation.py), the same kind
    # of data set as `name`: conversations: a held-out .json/.jsonl file or datasets folder
    # (required); cord_v2: the valid_split split of valid_path (null: data.path); mock: the
    # generator with seed data.seed + 1 (valid_path must stay null)
    valid_path: str | None = None
    valid_split: str = "validation"  # the split of valid_path (cord_v2) to validate on
    mock: MockConfig = field(default_factory=MockConfig)
    cord_v2: CordV2Config = field(default_factory=CordV2Config)
    conversations: ConversationsConfig = field(default_factory=ConversationsConfig)
    video: VideoConfig = field(default_factory=VideoConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    energon: EnergonConfig = field(default_factory=EnergonConfig)  # data.name=energon (data/energon.py)

    def validate(self) -> None:
        """This section's rules: its sub-sections' own, then the files the chosen data set needs."""
        for section in (self.mock, self.cord_v2, self.conversations, self.video, self.loader, self.energon):
            section.validate()
        check_dataset_name(self.name)
        _require(1 <= self.min_pixels <= self.max_pixels,
                 f"data.min_pixels ({self.min_pixels}) and data.max_pixels ({self.max_pixels}) need "
                 "1 <= min_pixels <= max_pixels")
        _require(len(self.image_mean) == 3 and len(self.image_std) == 3 and all(x > 0 for x in self.image_std),
                 "data.image_mean and data.image_std need 3 values (RGB), std > 0")
        _require(self.valid_path is None or self.name != "mock",
                 f"data.valid_path={self.valid_path!r} is for conversations and cord_v2 data; mock validation draws "
                 "its own held-out samples (seed data.seed + 1): set data.valid_path=null")
        if self.name == "conversations":
            _require(conversations_path(self.path),
                     "data.name=conversations needs data.path: an existing .json or .jsonl file or datasets folder, "
                     f"got {self.path!r}")
            _require(bool(self.tokenizer), "data.name=conversations needs data.tokenizer (a tokenizer directory)")
        if self.name == "cord_v2":
            _require(bool(self.path), "data.name=cord_v2 needs data.path (the CORD-v2 folder of parquet files)")
            _require(Path(self.path).exists(), f"data.path={self.path!r} does not exist (data.name=cord_v2 reads a "
                     "folder of parquet files, e.g. scripts/make_synthetic_cord.py's output); point data.path at it")
            _require(bool(self.tokenizer), "data.name=cord_v2 needs data.tokenizer (a tokenizer directory)")
