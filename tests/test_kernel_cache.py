"""train.kernel_cache: the kernel libraries' cache variables point into one folder, a user's own
setting wins, and autotune results are kept."""

from __future__ import annotations

import os

from core.kernel_cache import AUTOTUNE_VARIABLE, CACHE_VARIABLES, describe, use_kernel_cache


def test_caches_point_into_one_folder_unless_the_user_set_them(tmp_path, monkeypatch):
    for var in [*CACHE_VARIABLES, AUTOTUNE_VARIABLE]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "mine"))
    chosen = use_kernel_cache(tmp_path / "cache")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "triton")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    assert os.environ["TILELANG_CACHE_DIR"] == str(tmp_path / "mine")  # left alone
    assert not (tmp_path / "cache" / "tilelang").exists()
    assert (tmp_path / "cache" / "triton").is_dir() and os.environ[AUTOTUNE_VARIABLE] == "1"
    line = describe(chosen, tmp_path / "cache")
    assert line.startswith(f"kernel cache: {tmp_path / 'cache'}") and f"TILELANG_CACHE_DIR={tmp_path / 'mine'}" in line


def test_triton_reads_the_folder_when_it_compiles(tmp_path, monkeypatch):
    """Set after triton is imported: its knob reads the variable when a kernel is compiled."""
    import triton

    for var in CACHE_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    use_kernel_cache(tmp_path)
    assert triton.knobs.cache.dir == str(tmp_path / "triton")
    assert triton.knobs.autotuning.cache is True
