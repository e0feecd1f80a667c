"""Dataset registry: a recipe's ``data.name`` -> the function that builds that data set.

A data set is a module in data/ plus one entry in ``DATASET_REGISTRY``: a builder
``(model_cfg, data_cfg, seq_length) -> dataset`` whose ``dataset[i]`` is one sample (or None for
a row it skips; data/mock.py is the smallest). The config check and the loader both read the
names from here, so a misspelled ``data.name`` is refused with the list of what can be built.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from core.errors import ConfigError


def _mock(model_cfg, data_cfg, seq_length: int):
    """Synthetic conversations about generated images: no files, no tokenizer."""
    from data.mock import MockDataset

    return MockDataset(model_cfg, data_cfg, seq_length)


def _cord_v2(model_cfg, data_cfg, seq_length: int):
    """CORD-v2 receipts: the parquet files of data.path, tokenised with data.tokenizer."""
    from data.cord_v2 import CordV2Dataset

    return CordV2Dataset(
        model_cfg, data_cfg, seq_length, load_tokenizer(data_cfg), split=data_cfg.split,
        prompt=data_cfg.cord_v2.prompt, target_format=data_cfg.cord_v2.target_format,
        min_pixels=data_cfg.min_pixels, max_pixels=data_cfg.max_pixels,
    )


def _conversations(model_cfg, data_cfg, seq_length: int):
    """Your JSON/JSONL chat records (data/conversations.py), tokenised with data.tokenizer."""
    from data.conversations import ConversationsDataset

    return ConversationsDataset(model_cfg, data_cfg, seq_length, load_tokenizer(data_cfg))


def _energon(model_cfg, data_cfg, seq_length: int):
    """A Megatron-Energon prepared folder (data/energon.py), read as conversations with data.tokenizer."""
    from data.energon import EnergonDataset

    return EnergonDataset(model_cfg, data_cfg, seq_length, load_tokenizer(data_cfg))


DATASET_REGISTRY: dict[str, Callable] = {
    "mock": _mock,
    "cord_v2": _cord_v2,
    "conversations": _conversations,
    "energon": _energon,
}


def check_dataset_name(name: str) -> None:
    """Refuse a ``data.name`` that no entry builds, listing the ones that do."""
    if name not in DATASET_REGISTRY:
        raise ConfigError(f"data.name {name!r} is not available; choose: {', '.join(DATASET_REGISTRY)}")


def build_dataset(model_cfg, data_cfg, seq_length: int):
    """The data set ``data.name`` names, built from the recipe's model and data sections."""
    check_dataset_name(data_cfg.name)
    return DATASET_REGISTRY[data_cfg.name](model_cfg, data_cfg, seq_length)


def load_tokenizer(data_cfg):
    """The tokenizer of ``data.tokenizer``, which the tokenised data sets and the special-token ids read."""
    if not data_cfg.tokenizer:
        raise ValueError(f"data.name={data_cfg.name} needs data.tokenizer (a tokenizer directory)")
    return _tokenizer(str(data_cfg.tokenizer))


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    """One load per directory per process: start-up reads the special-token ids from it and the
    dataset then encodes with it (loading a real one takes seconds).
    Only read afterwards, never modified."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
