"""The learner's RNG checkpoint file: restored exactly, and read without running code.

The checkpoint directory is data (docs/architecture.md section 7): a file there
must not be able to run code in the learner when it resumes, so
``learner.rng.load_rng_state`` unpickles with ``weights_only=True``.
"""

from __future__ import annotations

import os
import pickle
import random

import numpy as np
import pytest
import torch

from learner.rng import load_rng_state, rng_state, seed_everything, set_rng_state


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_rng_state_round_trips_through_a_file(tmp_path):
    seed_everything(1234)
    _draws()  # move every generator off its seeded start
    torch.save(rng_state(), tmp_path / "rng-rank0.pt")
    expected = _draws()
    seed_everything(999)  # scramble
    set_rng_state(load_rng_state(tmp_path / "rng-rank0.pt"))
    assert _draws() == expected


class _RunsCode:
    """What a hostile writer of the checkpoint directory would plant: unpickling calls os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_file_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "rng-rank0.pt"
    torch.save({"python": random.getstate(), "evil": _RunsCode(marker)}, path)
    with pytest.raises(pickle.UnpicklingError):
        load_rng_state(path)
    assert not marker.exists()
