"""Several training runs in one torchrun launch (the processes start once: on a 2-core CI machine
starting 4 of them costs more than training the proxy a few steps).

``python -m torch.distributed.run --nproc-per-node N tests/helpers/mp_vpp.py RUNS.json``: RUNS.json is a
list of ``{"config": ..., "overrides": [...]}``; each is trained in turn by the Trainer
(``multimodal.training.train``, which sets up and tears down megatron's parallel state itself) and
writes its metrics under its own ``logging.dir``. ``train_in_process`` runs one in the calling
process, under the tests' one-rank state.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def train_in_process(config: str, overrides: list[str]):
    """The Trainer on ``config`` in this (one-rank) process; the tests' model-parallel state of size 1
    (conftest's ``mcore``) is set up again afterwards."""
    from megatron.core import parallel_state as ps

    from multimodal.config import load_config
    from multimodal.training import train  # which first drops the state an earlier run left

    try:
        return train(load_config(config, overrides))
    finally:
        ps.initialize_model_parallel(1, 1)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from multimodal.config import load_config
    from multimodal.training import train

    for run in json.loads(Path(sys.argv[1]).read_text()):
        train(load_config(run["config"], run["overrides"]))
