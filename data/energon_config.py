"""The recipe's ``data.energon`` section: how a Megatron-Energon prepared folder is read
(data/energon.py). Its own small file, so that the config loads without the data set's imports."""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import ConfigError


@dataclass
class EnergonConfig:
    split_part: str = "train"  # the split.yaml part to read (energon prepare's train / val / test)
    record_part: str = "json"  # CrudeSample: the part of each sample holding its conversation record
    caption_prompt: str | None = None  # CaptioningSample: the user's text after the image (null: the image alone)

    def validate(self) -> None:
        for key in ("split_part", "record_part"):
            if not getattr(self, key):
                raise ConfigError(f"data.energon.{key} must name a split part / sample part, "
                                  f"got {getattr(self, key)!r}")
