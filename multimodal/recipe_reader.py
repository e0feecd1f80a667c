"""Reading a recipe into typed sections: YAML with ``base:`` chains, dotted overrides, the renamed
keys of the previous layout, and the dataclass building that names the bad field.

``multimodal.config.load_config`` puts these together; nothing here knows the sections themselves:
a dataclass field whose class depends on its value (the ``model`` section, by ``model.name``) says
so in its metadata, ``field(metadata={SECTION_CLASS: pick})`` with ``pick(raw) -> class``.
"""

from __future__ import annotations

import dataclasses
import logging
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from core.errors import ConfigError

log = logging.getLogger(__name__)

SECTION_CLASS = "section_class"  # dataclass field metadata: raw value -> the dataclass to build


def dotted_keys(raw: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in raw.items():
        out += dotted_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return out


def read_recipe(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe's sections with its ``base:`` chain merged underneath: ``base`` names another recipe,
    relative to this one's folder, whose values this one's replace key by key (nested sections too)."""
    if not path.is_file():
        named_by = f" (the base named by {chain[-1]})" if chain else ""
        raise ConfigError(f"config file {path}{named_by} does not exist")
    here = path.resolve()
    if here in chain:
        loop = " -> ".join(str(p) for p in (*chain, here))
        raise ConfigError(f"recipe bases form a cycle: {loop}; remove one of these base: keys")
    raw = parse_yaml(path.read_text(), str(path)) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    raw = upgrade(raw, str(path))  # before the merge, so a base's section and a shorthand meet as mappings
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base must be the path of a recipe relative to {path.parent}, got {base!r}")
    return _merge(read_recipe(here.parent / base, (*chain, here)), raw)


# renamed keys

# Keys that moved into a section, old dotted name -> new. Accepted for one release with a
# one-line deprecation each (once per process); then this table goes.
_MOCK_KEYS = ("num_samples", "min_images", "max_images", "min_image_side", "max_image_side", "min_text_tokens",
              "max_text_tokens", "num_classes")
RENAMED_KEYS: dict[str, str] = {
    **{f"data.{k}": f"data.mock.{k}" for k in _MOCK_KEYS},
    **{f"data.{k}": f"data.cord_v2.{k}" for k in ("prompt", "target_format")},
    **{f"data.{k}": f"data.conversations.{k}" for k in ("image_root", "system_prompt")},
    **{f"data.video_{k}": f"data.video.{k}" for k in ("fps", "min_frames", "max_frames", "min_pixels", "max_pixels")},
    **{f"data.{k}": f"data.loader.{k}"
       for k in ("num_workers", "prefetch", "pack_lookahead", "pad_multiple", "max_bad_fraction")},
    **{f"train.cuda_graph_{k}": f"train.cuda_graphs.{k}"
       for k in ("max_samples", "vision_bucket", "vision_max_buckets", "vision_warmup_patches", "grads_to_main_grad")},
}
# sections that may be written as a bool: shorthand for their `enabled` field
SHORTHAND_SECTIONS = ("train.cuda_graphs",)
_deprecations_logged: set[str] = set()


def read_raw(path: str | Path | None, overrides: list[str] | None = None) -> dict[str, Any]:
    """The recipe at ``path`` (its ``base:`` chain merged) with ``section.key=value`` overrides on
    top and renamed keys moved to their new place: the raw tree the sections are built from."""
    raw = read_recipe(Path(path)) if path is not None else {}
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        parsed = parse_yaml(value, f"override {item!r}") if value.strip() else None
        set_dotted(raw, override_key(key.strip(), parsed), parsed)
    return upgrade(raw, "overrides")


def _new_key(old: str) -> str:
    """The current name of a dotted key, logging the deprecation the first time an old one is used."""
    new = RENAMED_KEYS.get(old)
    if new is None:
        return old
    if old not in _deprecations_logged:
        _deprecations_logged.add(old)
        log.warning("%s is deprecated: use %s", old, new)
    return new


def override_key(key: str, value: Any) -> str:
    if key in SHORTHAND_SECTIONS and isinstance(value, bool):
        return f"{key}.enabled"
    return _new_key(key)


def upgrade(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """A recipe's sections in the current layout: shorthand bools expanded, renamed keys moved
    (in place). A key given in both forms is refused: the two would silently disagree."""
    for dotted in SHORTHAND_SECTIONS:
        section, sub = dotted.split(".")
        node = raw.get(section)
        if isinstance(node, dict) and isinstance(node.get(sub), bool):
            node[sub] = {"enabled": node[sub]}
    for section in sorted({old.split(".")[0] for old in RENAMED_KEYS}):
        node = raw.get(section)
        if not isinstance(node, dict):
            continue
        for key in [k for k in node if f"{section}.{k}" in RENAMED_KEYS]:
            new = _new_key(f"{section}.{key}")
            _, sub, leaf = new.split(".")
            target = node.setdefault(sub, {})
            if not isinstance(target, dict):
                raise ConfigError(f"{where}: {new.rpartition('.')[0]} must be a mapping, got {target!r}")
            if leaf in target:
                raise ConfigError(f"{where}: {section}.{key} and {new} are both set; keep only {new}")
            target[leaf] = node.pop(key)
    return raw


def _merge(under: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over``'s values replace ``under``'s; a mapping on both sides is merged the same way, so a recipe
    sets one field of its base's section without repeating the others. Lists are values, not merged."""
    merged = dict(under)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = _merge(merged[key], value)
        merged[key] = value
    return merged


def parse_yaml(text: str, where: str):
    """PyYAML, with its error as ``where:line:column: problem`` (its own message spans many lines
    and names the stream ``<unicode string>``)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        problem = getattr(e, "problem", None) or getattr(e, "context", None) or str(e)
        at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None else where
        raise ConfigError(f"{at}: invalid YAML: {' '.join(str(problem).split())}") from None


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
    node[parts[-1]] = value


def build_section(cls: type, raw: Any, where: str):
    """The dataclass ``cls`` from a mapping, every value coerced to its field's type; an unknown
    key or a badly typed value is a ConfigError naming the dotted field (``where`` its prefix)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = set(fields)
    unknown = sorted(set(raw) - names)
    if unknown:
        bad = ", ".join(f"{where}{k}" for k in unknown)
        raise ConfigError(f"unknown config key(s): {bad}; valid keys here: {sorted(names)}")
    kwargs = {}
    for name, value in raw.items():
        pick = fields[name].metadata.get(SECTION_CLASS)
        tp = pick(value) if pick is not None else hints[name]
        kwargs[name] = _coerce(tp, value, f"{where}{name}")
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, where: str):
    if dataclasses.is_dataclass(tp):
        return build_section(tp, value, where + ".")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, where)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    return value
