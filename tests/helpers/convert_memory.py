"""Peak host memory of a streaming HF import and export, for tests/test_hf_streaming.py.

    python tests/helpers/convert_memory.py HF_DIR WORK_DIR  ->  one JSON line

Each phase's peak is the kernel's high-water mark of this process's resident memory (VmHWM, reset
between phases through /proc/self/clear_refs) less the resident memory when the phase began."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _phase(fn) -> int:
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


def main() -> None:
    from scripts import convert_hf

    hf_dir, work = sys.argv[1], Path(sys.argv[2])
    convert_hf._init()
    # a warm-up conversion pays the one-time costs (lazy imports, allocator pools) outside the probe
    convert_hf.do_import(hf_dir, str(work / "warm"), 1, 1, 1, workers=1)
    imp = _phase(lambda: convert_hf.do_import(hf_dir, str(work / "ckpt"), 1, 1, 1, workers=1))
    exp = _phase(lambda: convert_hf.do_export(str(work / "ckpt"), str(work / "out"), None, "auto", workers=1,
                                              shard_size="16MB"))
    print(json.dumps({"import_peak_bytes": imp, "export_peak_bytes": exp}))


if __name__ == "__main__":
    main()
