"""``tandem export`` on what the real learner wrote: the folder loads in transformers, PEFT and vLLM
and gives the learner's own log-probs; the real learner's retention keeps the best-scored version
beyond its rolling window and ``--version best`` exports it.

- Weights: two DeepSpeed steps on the session's tiny model (``one_rank_runs`` from
  tests/fixtures/learner.py: ZeRO-3 full weights, and LoRA published as a PEFT adapter), written
  into a run directory as the learner publishes them. Their export, loaded with transformers (and
  PEFT for the adapter folder), gives the log-probs the learner's engine reported for a fixed
  sequence, within the tolerance the publish-to-vLLM test uses (2e-4). One vLLM engine (the
  rollout server's ``RolloutEngine``, as tests/fixtures/rollout.py starts it) is started on a sharded
  export: its sample log-probs equal transformers' on the same folder.
- Retention: a learner process (real DeepSpeed, real Redis) trains 6 steps with ``keep = 1``,
  ``keep_every = 3``, ``keep_best = 1`` while held-out scores are recorded as a rollout server
  records them (``EvalLog.record``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deploy.cli import app
from tests.fixtures.learner import LORA_OVERRIDES, add_group, read_jsonl, write_run_config

pytestmark = pytest.mark.slow
TOL = 2e-4  # tests/integration/learner/test_publish_to_vllm.py: learner == HF == vLLM log-probs


def _export(*args) -> str:
    result = CliRunner().invoke(app, ["export", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result.stdout.strip().splitlines()[-1]


def _run_dir(top: Path, run_id: str, model: Path, sections: dict, versions: dict[int, object]) -> Path:
    """A run directory in ``tandem up``'s layout (``<top>/<run_id>/``) holding ``versions``: a
    safetensors file of full weights (written by the weight store's writer, as the learner's publish)
    or a version directory the learner's publish wrote (copied)."""
    from safetensors.torch import load_file

    from services import weightstore as store
    from services.config import parse_run_config

    base = top / run_id
    (base / "weights").mkdir(parents=True)
    raw = {"name": run_id, "model": {"path": str(model)}, "data": {"train": "t.jsonl"}, **sections}
    (base / "run-config.json").write_text(parse_run_config(raw).model_dump_json())
    for v, src in versions.items():
        if Path(src).is_dir():
            shutil.copytree(src, store.version_dir(base / "weights", v))
        else:
            store.write_version(base / "weights", v, load_file(src), step=2)
    return base


def _hf_logprobs(model, ids: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


def _report(run: Path) -> dict:
    return json.loads(run.with_name(run.name + ".json").read_text())


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
async def test_exports_of_learner_weights_give_the_learners_logprobs_in_transformers_peft_and_vllm(
        one_rank_runs, tiny_model, tmp_path):
    import torch
    from peft import PeftModel
    from prometheus_client import CollectorRegistry
    from transformers import AutoModelForCausalLM

    import rollout_server.engine as rollout_engine
    from rollout_server.metrics import RolloutMetrics
    from rollout_server.settings import RolloutSettings

    runs = tmp_path / "runs"
    zero3, lora = one_rank_runs["zero3"], one_rank_runs["lora"]
    full = _run_dir(runs, "full-run", tiny_model, {}, {2: zero3})
    adapter_dir = Path(_report(lora)["adapter"])  # the learner's adapter publish (PEFT layout)
    adapter = _run_dir(runs, "lora-run", tiny_model, LORA_OVERRIDES, {2: adapter_dir})

    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
    # full weights (ZeRO-3, gathered), sharded: transformers reads the index
    sharded = Path(_export(full, tmp_path / "full", "--max-shard-size", "30000"))
    assert (sharded / "model.safetensors.index.json").exists()
    probe, want = _report(zero3)["probe"], _report(zero3)["probe_logprobs"]
    assert _hf_logprobs(load(sharded), probe) == pytest.approx(want, abs=TOL)

    # LoRA published as an adapter: merged into full weights, and as a PEFT adapter folder
    lora_want = _report(lora)["probe_logprobs"]
    merged = Path(_export(adapter, tmp_path / "merged"))
    assert json.loads((merged / "tandem-export.json").read_text())["export"] == "model"
    assert _hf_logprobs(load(merged), probe) == pytest.approx(lora_want, abs=TOL)
    peft_dir = Path(_export(adapter, tmp_path / "adapter", "--lora", "adapter"))
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= {p.name for p in peft_dir.iterdir()}
    assert json.loads((peft_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_model)
    with_adapter = PeftModel.from_pretrained(load(tiny_model), peft_dir).eval()
    assert _hf_logprobs(with_adapter, probe) == pytest.approx(lora_want, abs=TOL)
    assert _hf_logprobs(load(tiny_model), probe) != pytest.approx(lora_want, abs=TOL)  # the adapter matters

    # vLLM starts on the sharded folder (its config, tokenizer and index) and samples with the
    # log-probs transformers gives on it. One engine start.
    engine = await rollout_engine.RolloutEngine.start(
        sharded, RolloutSettings(kv_cache_gib=0.25, enforce_eager=True, seed=0),
        metrics=RolloutMetrics(CollectorRegistry()), max_model_len=128)
    try:
        prompt = probe[:4]
        out = await engine.generate(prompt, rollout_engine.Sampling(n=2, temperature=1.0, max_tokens=8, seed=0))
    finally:
        engine.shutdown()
    hf = load(sharded)
    for s in out.samples:
        assert s.logprobs == pytest.approx(_hf_logprobs(hf, prompt + list(s.token_ids))[len(prompt) - 1:], abs=TOL)


async def test_the_learners_retention_keeps_the_best_version_and_export_picks_it(
        redis, keys, tiny_model, tmp_path, learner_proc):
    import torch
    from safetensors.torch import load_file

    from broker import Stream, WeightRegistry
    from services import weightstore as store
    from services.evaluate import EvalLog, EvalResult

    cfg = write_run_config(tmp_path / "run.toml", tiny_model, {
        "learner": {"steps": 6, "checkpoint_every": 0},
        "publish": {"keep": 1, "keep_every": 3, "keep_best": 1},
        "eval": {"every": 2},
    })
    # the held-out scores, as a rollout server records them after evaluating a version
    log = EvalLog(redis, keys)
    for version, accuracy in {2: 0.9, 4: 0.5, 6: 0.3}.items():
        assert await log.record(version, EvalResult(accuracy, accuracy, 10, frozenset({version}), 0), "test")
    proc = learner_proc(cfg, keys.run_id)
    registry, stream = WeightRegistry(redis, keys), Stream.trajectories(redis, keys)
    await stream.ensure_group()

    async def produce() -> None:  # the rollout side: groups of the newest version, a few unread at a time
        i = 0
        while True:
            if await stream.backlog() - await stream.pending() < 4:
                i += 1
                await add_group(redis, keys, await registry.latest_version(), seed=i)
            else:
                await asyncio.sleep(0.05)

    producer = asyncio.create_task(produce())
    try:
        await asyncio.to_thread(proc.wait_for, lambda s: s["state"] == "done", 300, "6 steps")
    finally:
        producer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await producer
    base = tmp_path / "runs" / keys.run_id
    assert [p["version"] for p in read_jsonl(base / "learner" / "published.jsonl")] == [1, 2, 3, 4, 5, 6]
    # kept: 6 (the window), 3 and 6 (keep_every), 2 (the best score); 4 scored lower, 1 and 5 have no claim
    assert store.on_disk(base / "weights") == [2, 3, 6]
    assert [w.version for w in await registry.history()] == [2, 3, 6]
    retention = json.loads((base / "weights" / "retention.json").read_text())
    assert retention["best"] == [2] and retention["kept"] == [2, 3, 6]
    assert json.loads((base / "run-config.json").read_text())["publish"]["keep_best"] == 1

    best = Path(_export(base, tmp_path / "best", "--version", "best"))
    assert json.loads((best / "tandem-export.json").read_text())["version"] == 2
    exported, kept = (load_file(p / "model.safetensors") for p in (best, store.version_dir(base / "weights", 2)))
    assert exported.keys() == kept.keys() and all(torch.equal(exported[k], kept[k]) for k in kept)
    result = CliRunner().invoke(app, ["export", str(base), str(tmp_path / "four"), "--version", "4"])
    assert result.exit_code == 1 and "versions kept: 2, 3, 6" in result.output
