"""Recipe loading, typed overrides, validation errors that name the field, --print-config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from multimodal.config import ConfigError, load_config, validate

PROXY = "configs/qwen35_vl_proxy.yaml"
RECIPES = ["configs/qwen35_vl_proxy.yaml", "configs/qwen35_vl_proxy_moe.yaml", "configs/qwen35_vl_2b.yaml"]


@pytest.mark.parametrize("path", RECIPES)
def test_recipes_load_and_validate(path):
    cfg = load_config(path)
    validate(cfg, world_size=1)
    for key in ("iters", "micro_batch_size", "global_batch_size", "seq_length"):
        assert hasattr(cfg.train, key)
    for key in ("tp", "pp", "cp", "ep"):
        assert getattr(cfg.parallel, key) >= 1


def test_overrides_are_typed_and_nested():
    cfg = load_config(PROXY, ["train.iters=7", "optimizer.lr=1e-4", "model.vision.depth=1",
                              "data.pack=false", "checkpoint.dir=/tmp/x", "model.mrope_section=[4,2,2]"])
    assert cfg.train.iters == 7 and isinstance(cfg.train.iters, int)
    assert cfg.optimizer.lr == pytest.approx(1e-4)
    assert cfg.model.vision.depth == 1
    assert cfg.data.pack is False
    assert cfg.checkpoint.dir == "/tmp/x"
    assert cfg.model.mrope_section == [4, 2, 2]
    # a float-valued field accepts an integer literal
    assert load_config(PROXY, ["optimizer.lr=1"]).optimizer.lr == 1.0


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.itres=3", "train.itres"),
        ("model.vision.dpeth=3", "model.vision.dpeth"),
        ("train.iters=three", "train.iters must be an integer"),
        ("data.pack=maybe", "data.pack must be true or false"),
        ("model.mrope_section=5", "model.mrope_section must be a list"),
        ("noequals", "section.key=value"),
    ],
)
def test_bad_keys_and_types_name_the_field(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        load_config(PROXY, [override])


@pytest.mark.parametrize(
    "overrides, world, needle",
    [
        (["train.global_batch_size=3"], 2, "global_batch_size"),
        (["parallel.tp=3"], 3, "num_attention_heads .* parallel.tp"),
        (["train.micro_batch_size=2", "train.global_batch_size=4"], 1, "data.pack=true"),
        (["parallel.tp=2"], 3, "not divisible by parallel.tp"),
        (["model.mrope_section=[3,3,3]"], 1, "mrope_section"),
        (["parallel.ep=2"], 2, "needs an MoE model"),
        (["train.iters=0"], 1, "train.iters must be >= 1"),
        (["checkpoint.load=latest", "checkpoint.dir=null"], 1, "checkpoint.dir"),
        (["data.mock.max_image_side=100"], 1, "multiples of patch_size"),
        (["model.image_token_id=5000"], 1, "vocab_size"),
    ],
)
def test_validation_names_the_fix(overrides, world, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(load_config(PROXY, overrides), world_size=world)


def test_print_config_cli_prints_resolved_yaml():
    # overrides on both sides of an option: argparse's plain parse_args would reject the second group
    out = subprocess.run(
        [sys.executable, "pretrain_multimodal.py", "--config", PROXY, "train.seed=7", "--print-config",
         "train.iters=11"],
        capture_output=True, text=True, check=True,
    ).stdout
    cfg = yaml.safe_load(out)
    assert cfg["train"]["iters"] == 11 and cfg["train"]["seed"] == 7
    assert cfg["model"]["name"] == "qwen35_vl"


def test_cli_reports_config_errors_with_exit_code_2():
    proc = subprocess.run(
        [sys.executable, "pretrain_multimodal.py", "--config", PROXY, "train.bogus=1"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert "train.bogus" in proc.stderr


def test_sft_recipe_validates_and_dry_runs_with_its_placeholders_filled(tmp_path):
    """configs/qwen35_vl_2b_sft.yaml ships placeholder paths (data, tokenizer, converted checkpoint);
    with real files in their place it passes every config rule and the dry run on one H200."""
    import json

    from data.tiny_tokenizer import build_tiny_tokenizer
    from multimodal.config import resolve_sources
    from multimodal.dry_run import dry_run

    build_tiny_tokenizer(tmp_path / "tok")
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    for name in ("train.jsonl", "valid.jsonl"):
        (tmp_path / name).write_text(json.dumps(record) + "\n")
    path = "configs/qwen35_vl_2b_sft.yaml"
    raw = load_config(path)
    assert raw.data.name == "conversations" and raw.train.eval_interval > 0 and raw.checkpoint.load
    assert raw.optimizer.lr < load_config("configs/qwen35_vl_2b.yaml").optimizer.lr  # fine-tuning LR
    cfg = resolve_sources(load_config(path, [f"data.path={tmp_path / 'train.jsonl'}",
                                             f"data.valid_path={tmp_path / 'valid.jsonl'}",
                                             f"data.tokenizer={tmp_path / 'tok'}"]))
    validate(cfg, world_size=1)
    lines = []
    assert dry_run(cfg, 1, 131, out=lines.append, config_path=path) == 0, "\n".join(lines)  # one H200
    with pytest.raises(ConfigError, match="data.valid_path"):  # the validation file is required
        validate(load_config(path, [f"data.path={tmp_path / 'train.jsonl'}", "data.valid_path=null",
                                    f"data.tokenizer={tmp_path / 'tok'}"]))


TINY = "tests/fixtures/tiny_dense_vl.yaml"


def test_model_section_is_read_into_the_class_of_its_family():
    """model.name picks the dataclass: each family's own fields are known to it alone."""
    from models import get_model_family

    qwen, tiny = load_config(PROXY).model, load_config(TINY).model
    assert type(qwen) is get_model_family("qwen35_vl").config_class
    assert type(tiny) is get_model_family("tiny_dense_vl").config_class
    assert type(load_config(None).model) is type(qwen)  # no model.name: the default family
    validate(load_config(TINY), world_size=1)
    # a Qwen3.5 field in the tiny model's section is an unknown key, named with its section
    with pytest.raises(ConfigError, match=r"unknown config key\(s\): model\.linear_num_key_heads; valid keys"):
        load_config(TINY, ["model.linear_num_key_heads=4"])
    # switching the family on the command line switches the section's class: the Qwen recipe's
    # own fields are then refused, by name
    with pytest.raises(ConfigError, match=r"unknown config key\(s\): model\.full_attention_interval, "):
        load_config(PROXY, ["model.name=tiny_dense_vl"])
    with pytest.raises(ConfigError, match=r"^model\.name 'llama' is not registered; known: \['qwen35_vl', "):
        load_config(PROXY, ["model.name=llama"])


@pytest.mark.parametrize("overrides, needle", [
    (["model.num_experts=4"], "model.num_experts=4: tiny_dense_vl has a dense MLP only"),
    (["model.lora.rank=4"], "tiny_dense_vl has no LoRA adapters"),
    (["train.recompute_modules=[gdn_qkv]"], r"model.name=tiny_dense_vl has no \['gdn_qkv'\]; choose from"),
    (["model.hf_config=/nonexistent"], "model.name=tiny_dense_vl has no Hugging Face config reader"),
])
def test_family_rules_refuse_what_the_family_lacks(overrides, needle):
    from multimodal.config import resolve_sources

    with pytest.raises(ConfigError, match=needle):
        validate(resolve_sources(load_config(TINY, overrides)), world_size=1)


FLAT = "tests/fixtures/recipes_flat.yaml"


@pytest.mark.parametrize("name", sorted(yaml.safe_load(open(FLAT))))
def test_recipes_resolve_to_their_flat_values(name, tmp_path):
    """Each recipe, read through its base: chain, is the Config its flat fixture entry gives, field for field."""
    flat = tmp_path / name
    flat.write_text(yaml.safe_dump(yaml.safe_load(open(FLAT))[name]))
    assert load_config(f"configs/{name}").to_dict() == load_config(flat).to_dict()


def test_full_size_recipes_name_a_base():
    """The token ids live in the base alone: a recipe that repeats them would drift from it unseen."""
    for name in ("2b", "2b_sft", "9b", "35b_a3b", "397b_a17b"):
        raw = yaml.safe_load(open(f"configs/qwen35_vl_{name}.yaml"))
        assert raw["base"].startswith("base/") and "image_token_id" not in raw["model"], name


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_base_chain_merges_key_by_key_under_the_recipe_then_the_overrides(tmp_path):
    # the chain recipe -> shared/mid.yaml -> root.yaml, each base path relative to its own file's folder
    _write(tmp_path / "root.yaml", "model: {vision: {depth: 5, hidden_size: 64}, vocab_size: 999}\n"
                                   "train: {iters: 3, seed: 11}\n")
    _write(tmp_path / "shared/mid.yaml", "base: ../root.yaml\nmodel: {vision: {depth: 4}}\ntrain: {iters: 4}\n")
    recipe = _write(tmp_path / "recipes/run.yaml", "base: ../shared/mid.yaml\ntrain: {iters: 6}\n"
                                                   "optimizer: {lr: 0.5}\n")
    cfg = load_config(recipe, ["model.vision.hidden_size=32"])
    assert (cfg.model.vision.depth, cfg.model.vision.hidden_size, cfg.model.vocab_size) == (4, 32, 999)
    assert (cfg.train.iters, cfg.train.seed, cfg.optimizer.lr) == (6, 11, 0.5)
    # the sections a recipe does not name keep their defaults; base: itself is no config field
    assert cfg.logging.dir == load_config(None).logging.dir and "base" not in cfg.to_dict()


@pytest.mark.parametrize("files, needle", [
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: a.yaml\n"}, r"recipe bases form a cycle: .*a\.yaml -> .*b\.yaml -> "
                                                               r".*a\.yaml; remove one of these base: keys"),
    ({"a.yaml": "base: a.yaml\n"}, "recipe bases form a cycle"),
    ({"a.yaml": "base: gone.yaml\n"}, r"config file .*gone\.yaml \(the base named by .*a\.yaml\) does not exist"),
    ({"a.yaml": "base: [b.yaml]\n"}, r"a\.yaml: base must be the path of a recipe relative to .*, got \['b\.yaml'\]"),
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "- 1\n"}, r"b\.yaml: top level must be a mapping of sections"),
])
def test_bad_bases_are_refused_in_one_line(tmp_path, files, needle):
    for name, text in files.items():
        _write(tmp_path / name, text)
    with pytest.raises(ConfigError, match=needle) as e:
        load_config(tmp_path / "a.yaml")
    assert "\n" not in str(e.value)


def test_dataset_names_are_read_from_the_registry(monkeypatch):
    """One list of names: the config check and the loader both read data.registry.DATASET_REGISTRY."""
    from data.registry import DATASET_REGISTRY, build_dataset

    names = ", ".join(DATASET_REGISTRY)
    assert names.startswith("mock, cord_v2, conversations")
    with pytest.raises(ConfigError, match=rf"^data.name 'mokc' is not available; choose: {names}$"):
        validate(load_config(PROXY, ["data.name=mokc"]))
    with pytest.raises(ConfigError, match=r"^data.name 'mokc' is not available; choose: "):
        cfg = load_config(PROXY)
        cfg.data.name = "mokc"
        build_dataset(cfg.model, cfg.data, 64)
    # an entry added to the registry is a name both accept
    built = object()
    monkeypatch.setitem(DATASET_REGISTRY, "mine", lambda model_cfg, data_cfg, seq_length: built)
    cfg = load_config(PROXY, ["data.name=mine"])
    validate(cfg)
    assert build_dataset(cfg.model, cfg.data, 64) is built


# ---------------------------------------------------------------- renamed keys


@pytest.fixture
def deprecations(monkeypatch, caplog):
    """The deprecation lines logged from here on (the once-per-process memory starts empty)."""
    import multimodal.recipe_reader as reader

    monkeypatch.setattr(reader, "_deprecations_logged", set())
    caplog.set_level("WARNING", logger="multimodal.recipe_reader")
    return lambda: [r.getMessage() for r in caplog.records if "is deprecated" in r.getMessage()]


NESTED = ["data.video.fps=3.0", "data.loader.num_workers=1", "data.mock.max_images=2",
          "data.cord_v2.target_format=donut", "data.conversations.system_prompt=Be brief.",
          "train.cuda_graphs.enabled=true", "train.cuda_graphs.max_samples=8"]


def test_old_flat_keys_in_recipes_and_overrides_map_to_sections_with_one_deprecation_each(tmp_path, deprecations):
    recipe = _write(tmp_path / "old.yaml", f"base: {Path(PROXY).resolve()}\n"
                    "data: {video_fps: 3.0, num_workers: 1, max_images: 2}\n"
                    "train: {cuda_graphs: true, cuda_graph_max_samples: 8}\n")
    old = ["data.target_format=donut", "data.system_prompt=Be brief."]
    for _ in range(2):  # a second load logs nothing more
        cfg = load_config(recipe, old)
    assert cfg.to_dict() == load_config(PROXY, NESTED).to_dict()
    assert (cfg.data.video.fps, cfg.data.loader.num_workers, cfg.train.cuda_graphs.max_samples) == (3.0, 1, 8)
    assert sorted(deprecations()) == sorted([
        "data.video_fps is deprecated: use data.video.fps",
        "data.num_workers is deprecated: use data.loader.num_workers",
        "data.max_images is deprecated: use data.mock.max_images",
        "train.cuda_graph_max_samples is deprecated: use train.cuda_graphs.max_samples",
        "data.target_format is deprecated: use data.cord_v2.target_format",
        "data.system_prompt is deprecated: use data.conversations.system_prompt",
    ])


def test_a_run_config_written_with_flat_keys_still_loads(tmp_path, deprecations):
    """tests/fixtures/config_flat_keys.yaml: a run's whole config (--print-config, config_to_yaml) in
    the flat form, every data and cuda_graph_* key at its section's top. (A checkpoint keeps only the
    model section, model_config.json, whose keys did not move.)"""
    from multimodal.config import config_to_yaml

    cfg = load_config("tests/fixtures/config_flat_keys.yaml")
    assert cfg.to_dict() == load_config(PROXY, NESTED).to_dict()
    assert len(set(deprecations())) == len(deprecations()) == 27  # 22 data keys, 5 train.cuda_graph_* keys
    validate(cfg)
    written = _write(tmp_path / "run.yaml", config_to_yaml(cfg))  # today's form, which reads back as itself
    assert "video_fps" not in yaml.safe_load(written.read_text())["data"]
    assert load_config(written).to_dict() == cfg.to_dict() and len(deprecations()) == 27


def test_cuda_graphs_shorthand_and_a_key_given_twice(tmp_path, deprecations):
    base = _write(tmp_path / "base.yaml", "train: {cuda_graphs: {enabled: true, max_samples: 4}}\n")
    child = _write(tmp_path / "child.yaml", "base: base.yaml\ntrain: {cuda_graphs: false}\n")
    g = load_config(child).train.cuda_graphs
    assert (g.enabled, g.max_samples) == (False, 4)  # the bool sets `enabled` only, the base's section stays
    g = load_config(base, ["train.cuda_graphs=false", "train.cuda_graphs=true"]).train.cuda_graphs
    assert (g.enabled, g.max_samples) == (True, 4)
    assert deprecations() == []  # the shorthand is not deprecated
    both = _write(tmp_path / "both.yaml", "data: {video_fps: 1.0, video: {fps: 2.0}}\n")
    with pytest.raises(ConfigError, match=r"data.video_fps and data.video.fps are both set; keep only data.video.fps$"):
        load_config(both)
    # an override in the old form replaces the recipe's value in the new one (overrides come last)
    assert load_config(PROXY, ["data.mock.max_images=2", "data.max_images=1"]).data.mock.max_images == 1


def test_processor_files_are_read_by_the_model_family(tmp_path):
    """What a checkpoint's preprocessor_config.json means is the family's (ModelFamily.processor_settings):
    Qwen3.5's reader takes its normalisation and refuses other patching; a family without one reads nothing."""
    import json

    from data.tiny_tokenizer import build_tiny_tokenizer
    from multimodal.config import resolve_sources

    build_tiny_tokenizer(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.1, 0.2, 0.3], "patch_size": 14}))
    with pytest.raises(ConfigError, match=r"patch_size=14 but the model's vision config has 16"):
        resolve_sources(load_config(PROXY, [f"data.tokenizer={tmp_path}"]))
    d = resolve_sources(load_config(TINY, [f"data.tokenizer={tmp_path}"])).data
    assert d.image_mean == [0.5, 0.5, 0.5]
