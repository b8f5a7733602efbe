"""``examples/presets/*.toml``: one run config per model preset and mode, valid and sized by the planner.

Each file names its model by ``model.path``'s directory (a preset of
``deploy/presets.py``) and notes, in a ``#   tandem plan ...`` comment, the
planner's smallest fitting GPU configuration (the learner's GPUs and, separate, those of one
rollout server, as deployed on Modal). The checks: the file loads with
``load_run_config``; its file name is ``<preset>-<mode>.toml``; every setting
the planner depends on (mode, ZeRO stage, offload, checkpointing, G, max
tokens, micro-batch tokens, LoRA rank and targets) agrees with the noted plan; that plan fits and
is what ``smallest_fit`` returns today (so a planner change that moves it
makes the comment stale, and this test says so).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from deploy import plan as planner
from deploy.presets import PRESETS, preset
from services.config import load_run_config

PRESET_DIR = Path(__file__).resolve().parents[3] / "examples" / "presets"
FILES = sorted(PRESET_DIR.glob("*.toml"))
MODES = ("lora", "full")
"""No ``qlora`` files: the learner (``learner/engine.py``) trains bf16/fp32 weights only, no 4-bit base."""


def noted_plan(path: Path) -> dict[str, str | bool]:
    """The ``tandem plan`` command noted in the file's comment, as {option: value} (``--offload``: True)."""
    lines = [ln for ln in path.read_text().splitlines() if re.match(r"#\s+tandem plan ", ln)]
    assert len(lines) == 1, f"{path.name}: expected one '#   tandem plan ...' comment line, found {len(lines)}"
    words = shlex.split(lines[0].lstrip("# "))[2:]
    opts: dict[str, str | bool] = {}
    while words:
        key = words.pop(0).removeprefix("--")
        opts[key] = True if not words or words[0].startswith("--") else words.pop(0)
    return opts


def test_one_file_per_preset_and_mode():
    expected = {f"{p.short_name.lower()}-{m}.toml" for p in PRESETS.values() for m in MODES}
    assert {f.name for f in FILES} == expected


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_preset_config_loads_and_fits_its_noted_plan(path: Path):
    cfg = load_run_config(path)
    p = preset(cfg.model.path.name)  # raises on a directory that names no preset
    mode = "lora" if cfg.learner.lora is not None else "full"
    assert path.name == f"{p.short_name.lower()}-{mode}.toml"
    assert cfg.name == path.stem
    assert cfg.model.dtype == "bfloat16" and cfg.learner.precision == "bf16"
    assert cfg.data.train.is_file()

    opts = noted_plan(path)
    assert preset(str(opts["model"])) == p and opts["mode"] == mode
    offload = bool(opts.get("offload", False))
    # the settings the plan assumed are the settings the file trains with
    assert cfg.learner.zero_stage == int(opts["zero-stage"])
    assert cfg.learner.offload_optimizer == offload
    assert cfg.learner.offload_params == (offload and cfg.learner.zero_stage == 3)
    assert cfg.learner.gradient_checkpointing and "no-checkpointing" not in opts
    assert cfg.sampling.group_size == int(opts["group-size"]) and cfg.sampling.max_tokens == int(opts["max-tokens"])
    # the planner sizes activations for the micro-batch budget and logit chunk the learner uses
    assert cfg.learner.micro_batch_tokens == int(opts["micro-batch-tokens"])
    assert cfg.learner.logit_chunk_tokens == planner.LOGIT_CHUNK_TOKENS and "logit-chunk-tokens" not in opts
    assert cfg.loss.beta == 0  # no reference model in the plan
    kwargs = dict(group_size=cfg.sampling.group_size, max_tokens=cfg.sampling.max_tokens, checkpointing=True,
                  beta=cfg.loss.beta, micro_batch_tokens=cfg.learner.micro_batch_tokens,
                  logit_chunk_tokens=cfg.learner.logit_chunk_tokens)
    if cfg.learner.lora is not None:
        # the planner counts a rank-r adapter on q/k/v/o
        assert sorted(cfg.learner.lora.target_modules) == ["k_proj", "o_proj", "q_proj", "v_proj"]
        kwargs["lora_rank"] = cfg.learner.lora.r
        assert cfg.publish.lora_format == "adapter"  # the rollout server serves each version as a LoRA adapter

    # the layout as deployed: rollout servers on GPUs of their own (tests/unit/deploy/test_layout.py
    # checks examples/presets/modal/ deploys exactly this)
    assert "colocated" not in opts
    result = planner.plan(p, mode, str(opts["gpus"]), zero_stage=cfg.learner.zero_stage, offload=offload,
                          rollout_gpus=str(opts["rollout-gpus"]), **kwargs)
    assert result.fits, f"{path.name}: {result.label} needs {result.total:.1f} GB per GPU > {result.budget:.1f}"
    smallest = planner.smallest_fit(p, mode, result.gpu, offload=offload, **kwargs)
    assert smallest is not None and smallest.label == result.label, (
        f"{path.name}: the planner's smallest fit is now {smallest and smallest.label}, the file notes {result.label}"
    )
    assert f"): {result.label}." in path.read_text(), f"{path.name}: the comment's label is not {result.label}"
