"""The learner compiles nothing when it starts, on one rank or two.

DeepSpeed's CPU communication backend JIT-compiles a C++ op (``deepspeed_shm_comm``) when the
process group starts, unless told not to (``learner.distributed._without_shm_op``): 30-130 s on this
machine, before the first step. Here the learner's engine takes a real ZeRO-2 step
(``tests.selfcheck``) with an empty extension cache and a C++ compiler that only records that it
was called and fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from host.processes import free_port

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed]

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.long  # over 12 s in make test (docs/testing.md): make test-long runs it
@pytest.mark.parametrize("ranks", [1, 2])
def test_the_engine_starts_and_steps_without_compiling(tmp_path, tiny_model, ranks):
    calls = tmp_path / "compiler-calls"
    compiler = tmp_path / "c++"
    compiler.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexit 1\n")
    compiler.chmod(0o755)
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env.update(CXX=str(compiler), TORCH_EXTENSIONS_DIR=str(extensions), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    args = ["-m", "tests.selfcheck", "--model", str(tiny_model), "--out", str(tmp_path / "w.safetensors"),
            "--zero-stage", "2", "--steps", "1"]
    launcher = [sys.executable] if ranks == 1 else [str(Path(sys.executable).with_name("torchrun")),
                                                     "--nproc_per_node", "2", "--master_port", str(free_port())]
    proc = subprocess.run([*launcher, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          start_new_session=True)
    said = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, said
    assert not calls.exists(), calls.read_text()
    assert list(extensions.iterdir()) == []
    assert (tmp_path / "w.safetensors").exists()
