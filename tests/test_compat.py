"""core/compat.py: every megatron-core internal the project patches or reads exists in the
installed megatron-core, and one that does not stops start-up in one line naming it and its user."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core import compat

ROOT = Path(__file__).resolve().parents[1]


def test_every_listed_internal_exists_in_the_installed_megatron_core():
    assert compat.missing() is None
    compat.check()
    for internal in compat.INTERNALS:
        assert (ROOT / internal.user).is_file(), internal  # the file named as its user is real
    # the RNG helpers, the optimizer's private methods and a multi-tensor hook, by name
    names = {i.name for i in compat.INTERNALS}
    assert {"megatron.core.tensor_parallel.random._get_cuda_rng_state",
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._get_model_param_range_map",
            "megatron.core.optimizer.clip_grads.l2_norm_impl"} <= names


def test_a_missing_internal_is_one_line_naming_it_and_its_user():
    gone = compat.Internal("megatron.core.tensor_parallel.random", "_renamed_in_a_later_release",
                           "multimodal/performance/recompute.py")
    with pytest.raises(compat.MegatronCompatError) as err:
        compat.check((*compat.INTERNALS, gone))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("megatron-core ") and " has no megatron.core.tensor_parallel.random._renamed_in_a_later_release," in msg
    assert "multimodal/performance/recompute.py needs" in msg and f"megatron-core=={compat.TESTED_VERSION}" in msg
    # a missing module, a missing class member and a global the module's source no longer reads
    for internal in (compat.Internal("megatron.core.no_such_module", "x", "u"),
                     compat.Internal("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._gone", "u"),
                     compat.Internal("megatron.core.tensor_parallel.layers", "no_such_extension", "u", global_read=True)):
        assert compat.missing((internal,)) is internal


def test_no_megatron_private_name_is_patched_outside_the_list():
    """A ``module._name = ...`` on a megatron module, or a ``megatron_object._name`` read, in the
    source tree names an internal core/compat.py lists (so an upgrade is caught at start-up)."""
    listed = {i.last for i in compat.INTERNALS}
    # the aliases the project gives megatron modules and objects where it reaches their internals
    pattern = re.compile(r"\b(?:mcore_\w+|megatron_opt|fa|layers|clip_grads|moptimizer|DistributedOptimizer|module)"
                         r"\.(_[A-Za-z]\w*)")
    found = {}
    for folder in ("core", "fused_kernels", "models", "data", "multimodal", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in pattern.findall(path.read_text()):
                found.setdefault(name, str(path.relative_to(ROOT)))
    unlisted = {name: path for name, path in found.items() if name not in listed}
    assert not unlisted, f"megatron internals used but not in core/compat.py: {unlisted}"
