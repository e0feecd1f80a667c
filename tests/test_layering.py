"""The packages import in one direction only, and no module imports itself back.

Layers, lowest first; a module may import its own layer and the layers below, never above:

    core  <  fused_kernels  <  models  <  data  <  multimodal  <  pretrain_multimodal.py, scripts/

- ``core/``: fault types, host->device copies, seeding, the zigzag CP layout; imports nothing of ours.
- ``fused_kernels/``: Triton kernels beside their PyTorch references.
- ``models/``: the layers and the architectures, with their config sections and HF adapters.
- ``data/``: data sets and collation; reads the model's input geometry (patchify, MRoPE ids) from models.
- ``multimodal/``: the trainer (recipe, training loop, checkpoints, tools that load a recipe).

Speed machinery is split across two layers by who imports it: ``models/performance/`` (CUDA graphs,
weight-gradient fusion, grouped main_grad adds) wraps model layers and is imported by the model
packages, so it sits in models/; ``multimodal/performance/`` (optimizer patches, recompute) patches
megatron's optimizer and DDP, which only the trainer owns. What a run reports about itself
(metrics, step clock, profiler, memory tools) is ``multimodal/observability/``.

An architecture is a plug-in: nothing outside its folder ``models/<name>/`` imports it, save the
registry (``models/__init__.py``); the trainer, the data pipeline and the scripts reach it through
its ``ModelFamily``.

Every import counts, at the top of a file or inside a function, ``import a.b`` and
``from a import b`` alike, relative ones resolved. Cycles between our modules are refused too,
function-level imports included: a lazy import that closes a cycle (the two this test was written
against each had one) still ties the two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("core", "fused_kernels", "models", "data", "multimodal")  # lowest first


def _module_name(path: Path, root: Path) -> tuple[str, bool]:
    """Dotted module name of ``path`` (relative to the repo root), and whether it is a package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            out[_module_name(path, root)[0]] = path
    return out


def _imports(path: Path, known: dict[str, Path], root: Path):
    """(line, target module, text) for every import in ``path``. The target is ``a.b`` for
    ``from a import b`` when ``a.b`` is a module of ours, else ``a``."""
    name, is_package = _module_name(path, root)
    tree = ast.parse(path.read_text(), filename=str(path))

    for node in ast.walk(tree):  # every node, function bodies included
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package of this module, up level-1 packages
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                full = f"{base}.{alias.name}"
                target = full if full in known else base
                yield node.lineno, target, f"from {'.' * node.level}{node.module or ''} import {alias.name}"


def _entry_points(root: Path) -> dict[str, Path]:
    """The modules above the layers: the launcher and the scripts."""
    paths = [root / "pretrain_multimodal.py", *sorted((root / "scripts").rglob("*.py"))]
    return {_module_name(path, root)[0]: path for path in paths if path.is_file()}


def family_imports_from_outside(root: Path = ROOT) -> list[str]:
    """Imports of a model family's package (a folder ``models/<name>/`` with a family.py) from a
    module outside that folder, the registry ``models/__init__.py`` excepted."""
    families = {f"models.{path.parent.name}" for path in (root / "models").glob("*/family.py")}
    known = {**_modules(root), **_entry_points(root)}
    bad = []
    for module, path in known.items():
        if module == "models":  # the registry: MODEL_REGISTRY imports every family
            continue
        for line, target, text in sorted(_imports(path, known, root)):
            family = ".".join(target.split(".")[:2])
            if family in families and module != family and not module.startswith(family + "."):
                bad.append(f"{path.relative_to(root)}:{line}: {text} (reach {family} through its ModelFamily)")
    return bad


def _layer(module: str) -> int | None:
    top = module.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else None


def upward_imports(root: Path = ROOT) -> list[str]:
    known = _modules(root)
    bad = []
    for module, path in known.items():
        own = _layer(module)
        for line, target, text in sorted(_imports(path, known, root)):
            other = _layer(target)
            if other is not None and other > own:
                bad.append(f"{path.relative_to(root)}:{line}: {text} ({LAYERS[own]}/ must not import {LAYERS[other]}/)")
    return bad


def import_cycles(root: Path = ROOT) -> list[str]:
    """One cycle per group of our modules that import each other, as 'a (file:line) -> b (...) -> a'."""
    known = _modules(root)
    edges: dict[str, dict[str, str]] = {m: {} for m in known}
    for module, path in known.items():
        for line, target, _ in _imports(path, known, root):
            if target in known and target != module:
                edges[module].setdefault(target, f"{path.relative_to(root)}:{line}")
    # Tarjan's strongly connected components; every component of more than one module has a cycle
    index, low, stack, on_stack, sccs, counter = {}, {}, [], set(), [], [0]

    def strongconnect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(set(scc))

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    cycles = []
    for scc in sccs:  # one concrete cycle per component: walk inside it until a module repeats
        path, seen = [min(scc)], {}
        while path[-1] not in seen:
            seen[path[-1]] = len(path) - 1
            path.append(min(w for w in edges[path[-1]] if w in scc))
        cycle = path[seen[path[-1]]:]
        cycles.append(" -> ".join(f"{a} ({edges[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}")
    return cycles


def test_the_scan_sees_the_packages():
    known = _modules()
    assert all(any(m.split(".")[0] == layer for m in known) for layer in LAYERS)
    assert len(known) > 50


def test_no_layer_imports_a_higher_one():
    bad = upward_imports()
    assert not bad, "imports against the layering (core < fused_kernels < models < data < multimodal):\n" + "\n".join(bad)


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_module_outside_a_family_imports_it():
    bad = family_imports_from_outside()
    assert not bad, "imports of a model family from outside its folder:\n" + "\n".join(bad)


def test_the_family_scan_sees_a_violation(tmp_path):
    """A tree with one import of a family from the trainer and one from a script, beside the
    imports that are allowed (the registry, the family's own modules)."""
    files = {
        "models/__init__.py": "from models.fam.family import FAMILY\n",
        "models/family.py": "",
        "models/fam/__init__.py": "",
        "models/fam/family.py": "from models.fam import layers\n",
        "models/fam/layers.py": "from . import family\n",
        "multimodal/__init__.py": "",
        "multimodal/train.py": "def f():\n    import models.fam.layers\n",
        "scripts/tool.py": "from models import fam\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    bad = family_imports_from_outside(tmp_path)
    assert [b.split(":")[0] for b in bad] == ["multimodal/train.py", "scripts/tool.py"], bad
