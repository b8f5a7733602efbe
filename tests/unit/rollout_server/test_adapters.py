"""The adapter transport's checks before vLLM sees a LoRA version, and which runs an engine serves,
without an engine (tests/integration/rollout_server/test_lora_adapter.py loads adapters into vLLM).

Adapters are written by the publish writer (``services.weightstore.write_version`` in PEFT's layout, as
``learner.publisher.publish_tensors`` asks it to); the reference signature is the base model's."""

from __future__ import annotations

import json

import pytest

from rollout_server.adapters import (
    AdapterTransport,
    lora_engine_args,
    lora_rank,
    lora_targets,
    max_lora_rank,
    misfit,
)
from rollout_server.transports import WeightLoadError
from services.config import parse_run_config

HIDDEN, KV = 8, 4
REFERENCE = {
    "model.embed_tokens.weight": (16, HIDDEN),
    "model.layers.0.self_attn.q_proj.weight": (HIDDEN, HIDDEN),
    "model.layers.0.self_attn.v_proj.weight": (KV, HIDDEN),
}
PREFIX = "base_model.model.model.layers.0.self_attn"


def _tensors(r: int = 2, **shapes):
    import torch

    default = {f"{PREFIX}.q_proj.lora_A.weight": (r, HIDDEN), f"{PREFIX}.q_proj.lora_B.weight": (HIDDEN, r),
               f"{PREFIX}.v_proj.lora_A.weight": (r, HIDDEN), f"{PREFIX}.v_proj.lora_B.weight": (KV, r)}
    default.update(shapes)
    return {name: torch.zeros(shape) for name, shape in default.items() if shape is not None}


def _write(root, version: int, tensors, r: int = 2, peft_type: str = "LORA"):
    from services import weightstore as store

    config = json.dumps({"peft_type": peft_type, "r": r, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]})
    return store.write_version(root, version, tensors, weights_name="adapter_model.safetensors",
                               extra_files={"adapter_config.json": config})


async def _prepare(tmp_path, written, sha: str | None = None, max_rank: int = 8, targets: list[str] | None = None):
    from services.wire import LoadWeights

    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    transport = AdapterTransport(base, REFERENCE, max_rank, targets=targets)
    return await transport.prepare(LoadWeights(version=written.version, uri=str(written.path),
                                               sha256=sha or written.sha256))


async def test_adapter_of_the_model_is_prepared(tmp_path):
    written = _write(tmp_path / "w", 1, _tensors())
    prepared = await _prepare(tmp_path, written)
    assert prepared.location == written.path and prepared.bytes == written.bytes


async def test_base_directory_means_no_adapter(tmp_path):
    from services.wire import LoadWeights

    transport = AdapterTransport(tmp_path, REFERENCE, 8)
    prepared = await transport.prepare(LoadWeights(version=0, uri=str(tmp_path)))
    assert prepared.location is None


@pytest.mark.parametrize(("tensors", "r", "peft_type", "match"), [
    (_tensors(r=16), 16, "LORA", "rank 16 is not within 1..8"),
    (_tensors(**{f"{PREFIX}.v_proj.lora_B.weight": (HIDDEN, 2)}), 2, "LORA", r"v_proj.lora_B.weight: shape \(8, 2\)"),
    (_tensors(**{f"{PREFIX}.q_proj.lora_A.weight": (2, KV)}), 2, "LORA", r"q_proj.lora_A.weight: shape \(2, 4\)"),
    (_tensors(**{f"{PREFIX}.o_proj.lora_A.weight": (2, HIDDEN)}), 2, "LORA", "o_proj.lora_A.weight: not a LoRA matrix"),
    (_tensors(), 2, "PREFIX_TUNING", "not LORA"),
], ids=["rank", "rows", "columns", "module", "peft-type"])
async def test_adapter_that_does_not_fit_is_refused(tmp_path, tensors, r, peft_type, match):
    written = _write(tmp_path / "w", 1, tensors, r=r, peft_type=peft_type)
    with pytest.raises(WeightLoadError, match=match) as e:
        await _prepare(tmp_path, written)
    assert e.value.status == 422


async def test_adapter_of_modules_the_engine_does_not_wrap_is_refused(tmp_path):
    written = _write(tmp_path / "w", 1, _tensors())
    assert (await _prepare(tmp_path, written, targets=["q_proj", "v_proj"])).location == written.path
    with pytest.raises(WeightLoadError, match=r"v_proj.lora_A.weight: the engine serves LoRA on \['q_proj'\] only"):
        await _prepare(tmp_path, written, targets=["q_proj"])


async def test_full_weights_and_a_wrong_checksum_are_refused(tmp_path):
    import torch

    from services import weightstore as store

    full = store.write_version(tmp_path / "w", 1, {"model.embed_tokens.weight": torch.zeros(16, HIDDEN)})
    with pytest.raises(WeightLoadError, match="not a PEFT adapter") as e:
        await _prepare(tmp_path, full)
    assert e.value.status == 422
    written = _write(tmp_path / "w", 2, _tensors())
    with pytest.raises(WeightLoadError, match="sha256|checksum") as e:
        await _prepare(tmp_path, written, sha="0" * 64)
    assert e.value.status == 422


def test_max_lora_rank_rounds_up_to_what_vllm_accepts():
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 64, 500)] == [1, 8, 8, 16, 64, 512]
    with pytest.raises(ValueError, match="above vLLM's largest"):
        max_lora_rank(513)


def test_which_runs_an_engine_serves(tmp_path):
    base = {"model": {"path": "m"}, "data": {"train": "t.jsonl"}}
    full = parse_run_config(base)
    merged = parse_run_config({**base, "learner": {"lora": {"r": 8}}})
    adapter = parse_run_config({**base, "learner": {"lora": {"r": 16}}, "publish": {"lora_format": "adapter"}})
    assert (lora_rank(full), lora_rank(merged), lora_rank(adapter)) == (None, None, 16)
    assert (lora_targets(merged), lora_targets(adapter)) == (None, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert lora_engine_args(16, lora_targets(adapter)) == {
        "enable_lora": True, "max_lora_rank": 16, "max_loras": 1, "max_cpu_loras": 2,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    assert lora_engine_args(4)["lora_target_modules"] is None and lora_engine_args(4)["max_lora_rank"] == 8
    serving = AdapterTransport(tmp_path, REFERENCE, 16)
    assert misfit(full, None) is None and misfit(merged, None) is None and misfit(adapter, serving) is None
    assert "full weights" in misfit(adapter, None)
    assert "serves LoRA adapters" in misfit(merged, serving)
    assert "above this server's max_lora_rank 8" in misfit(adapter, AdapterTransport(tmp_path, REFERENCE, 8))
