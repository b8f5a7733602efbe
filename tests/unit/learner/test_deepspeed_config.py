"""Learner-facing run-config fields and the DeepSpeed config built from them."""

from __future__ import annotations

import pytest

from services.config import ConfigError, parse_run_config


def config(**sections):
    base = {"model": {"path": "m"}, "data": {"train": "t.jsonl"}}
    base.update(sections)
    return parse_run_config(base)


def test_adapter_publishing_needs_lora():
    with pytest.raises(ConfigError, match="publish.lora_format"):
        config(publish={"lora_format": "adapter"})
    cfg = config(publish={"lora_format": "adapter"}, learner={"lora": {"r": 4}})
    assert cfg.publish.lora_format == "adapter"


def test_deepspeed_config_follows_the_learner_section():
    from learner.engine import ds_config

    ds = ds_config(config(learner={"zero_stage": 3, "offload_optimizer": True, "offload_params": True,
                                   "precision": "bf16", "grad_clip": 0.5}))
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["bf16"]["enabled"] is True and ds["gradient_clipping"] == 0.5
    assert ds["gradient_accumulation_steps"] == 1  # the trainer sets the accumulation boundary itself
    plain = ds_config(config())
    assert plain["zero_optimization"] == {"stage": 2} and plain["bf16"]["enabled"] is False
