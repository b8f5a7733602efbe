"""This rank's random number generators (Python, numpy, torch): seeded, saved with a checkpoint, restored.

``learner.engine.LearnerEngine`` seeds them from ``learner.seed`` when it is built, saves
:func:`rng_state` beside each checkpoint (one file per rank) and restores it on load, so that a
resumed run draws what an uninterrupted one would have.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def rng_state() -> dict:
    import numpy as np

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def load_rng_state(path: Path) -> dict:
    """Read a file :func:`rng_state` wrote, with ``weights_only=True``: the checkpoint directory is
    data, and unpickling it with ``weights_only=False`` would run any code a writer put there.
    Beyond torch's own types, only what numpy's MT19937 key (a uint32 ``ndarray``) needs is
    allowed; an object array would still unpickle its items through the restricted unpickler."""
    import numpy as np

    keys = np.random.get_state()[1]
    # _reconstruct lives in numpy.core or numpy._core, by numpy version: take it from an array
    allowed = [keys.__reduce__()[0], np.ndarray, np.dtype, type(keys.dtype)]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, weights_only=True)


def set_rng_state(state: dict) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
