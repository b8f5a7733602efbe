"""A verifiers environment built here drives the session's real vLLM engine through the rollout server, and
its episodes become tandem training groups (``rollout_server.verifiers_env``) that the real learner trains on.

The environment (``ENV_MODULE``, written to a temporary folder and imported by id, as verifiers imports an
installed one): three-digit sums; a harness whose program (``PROGRAM``, run by verifiers' subprocess runtime
with this interpreter) asks the model (streamed), then hands it the environment's calculator result as a ``tool``
message and asks again; a rubric of two ``@vf.reward`` functions (the sum in the last answer, weight 1; its
share of digits, weight 0.5). The train-client path (``/inference/v1/generate``) keeps the model's tokens
exactly across both turns: the log-probs of every generated token of a sample, recomputed by Hugging Face on
the group prompt plus the sample's tokens, equal the engine's. The eval-client path relays the same
harness's OpenAI requests to ``/v1/chat/completions`` unchanged and gets the tandem fields back."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.rollout import TOKEN

pytestmark = [pytest.mark.usefixtures("engine_left_serving"), pytest.mark.slow]

TOKEN_VAR = "TANDEM_TEST_VERIFIERS_TOKEN"

ENV_MODULE = '''
"""tandem_sums_env: three-digit sums with a calculator the environment runs."""
import sys
from pathlib import Path

import verifiers.v1 as vf

PROGRAM = Path(__file__).with_name("tandem_sums_program.py")


class SumData(vf.TaskData):
    a: int
    b: int


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(str(self.data.a + self.data.b) in (trace.last_message.content or ""))

    @vf.reward(weight=0.5)
    async def digits(self, trace: vf.Trace) -> float:
        text = trace.last_message.content or ""
        return sum(c.isdigit() for c in text) / max(len(text), 1)


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 2


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        return [SumTask(SumData(prompt=f"{100 + 7 * i}+{200 + 3 * i}=", a=100 + 7 * i, b=200 + 3 * i))
                for i in range(self.config.num_tasks)]


class SumHarnessConfig(vf.HarnessConfig):
    pass


class SumHarness(vf.Harness[SumHarnessConfig]):
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        relayed = isinstance(ctx.client, vf.EvalClientConfig)  # the endpoint's own answer reaches the program
        argv = [sys.executable, str(PROGRAM), endpoint, secret, ctx.model, data.prompt, str(relayed)]
        return await runtime.run_program(argv, {})


__all__ = ["SumTaskset", "SumHarness"]
'''

PROGRAM = '''
import re, sys

import openai

base, key, model, prompt, relayed = sys.argv[1:6]
client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
messages = [{"role": "user", "content": prompt}]
first = "".join(chunk.choices[0].delta.content or "" for chunk in  # the first turn streamed, the second not
                client.chat.completions.create(model=model, messages=messages, stream=True) if chunk.choices)
messages.append({"role": "assistant", "content": first})
a, b = map(int, re.findall(r"[0-9]+", prompt)[:2])
messages.append({"role": "tool", "content": f"calculator: {a}+{b}={a + b}"})
second = client.chat.completions.create(model=model, messages=messages)
extra = second.model_extra or {}
if relayed == "True" and not (isinstance(extra.get("weight_version"), int) and extra.get("prompt_token_ids")
                              and second.choices[0].model_extra.get("token_ids")):
    sys.exit(f"the relayed answer lacks tandem's fields: {sorted(extra)}")
'''

OBSERVATION = "\n<|tool|>calculator: {a}+{b}={s}\n<|assistant|>"


@pytest.fixture(scope="module")
def sums_env(tmp_path_factory):
    # imported here, not at the module's top: verifiers takes seconds to import, and test-fast collects this file
    pytest.importorskip("verifiers.v1", reason="the verifiers extra is not installed (pip install -e '.[verifiers]')")
    folder = tmp_path_factory.mktemp("verifiers-env")
    (folder / "tandem_sums_env.py").write_text(ENV_MODULE)
    (folder / "tandem_sums_program.py").write_text(PROGRAM)
    sys.path.insert(0, str(folder))
    try:
        yield "tandem_sums_env"
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("tandem_sums_env", None)


@pytest.fixture
def token_var(monkeypatch):
    monkeypatch.setenv(TOKEN_VAR, TOKEN)
    return TOKEN_VAR


async def _groups(rollout_server, env_id, token_var, n=3):
    from rollout_server.verifiers_env import VerifiersGroups, load_env

    env = load_env(env_id, harness=env_id)
    engine = rollout_server.app.state.engine
    async with VerifiersGroups(env, base_url=f"{rollout_server.url}/v1", token_var=token_var,
                               model_dir=engine.model_dir, run_id="vf-test",
                               sampling={"max_tokens": 10, "temperature": 1.0}) as source:
        tasks = list(env.taskset)
        return tasks, [await source.group(task, n) for task in tasks], source.versions_inexact


@pytest.mark.long  # over 25 s in make test (docs/testing.md): make test-long runs it
async def test_a_verifiers_env_becomes_token_exact_training_groups(rollout_server, sums_env, token_var, hf_logprobs,
                                                                  weight_versions, tiny_model, tmp_path):
    engine = rollout_server.app.state.engine
    version = engine.version
    tasks, groups, inexact = await _groups(rollout_server, sums_env, token_var)
    assert inexact == 0 and len(groups) == 2
    two_turns = 0
    for task, group in zip(tasks, groups, strict=True):
        assert group.n == 3 and group.policy_version == version
        assert group.prompt == f"<bos><|user|>{task.data.prompt}\n<|assistant|>"  # the model's chat template
        observation = OBSERVATION.format(a=task.data.a, b=task.data.b, s=task.data.a + task.data.b)
        for s in group.samples:
            assert len(s.mask) == len(s.token_ids) == len(s.logprobs) and s.mask[-1] == 1
            assert s.turns in (1, 2) and s.turn_versions == [version] * s.turns and s.tool_calls == 1
            outside = engine.tokenizer.decode([t for t, m in zip(s.token_ids, s.mask, strict=True) if not m])
            assert observation in outside and observation not in engine.tokenizer.decode(
                [t for t, m in zip(s.token_ids, s.mask, strict=True) if m])
            assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.mask, strict=True) if not m)
            # the engine's behaviour log-probs of every generated token, recomputed on exactly these ids
            ref = hf_logprobs(weight_versions.dir_of(version), group.prompt_token_ids, s.token_ids)
            worst = max(abs(a - b) for a, b, m in zip(s.logprobs, ref, s.mask, strict=True) if m)
            assert worst < 2e-3, worst
            assert s.reward == pytest.approx(s.components["correct"] + 0.5 * s.components["digits"])
            two_turns += s.turns == 2
    assert two_turns >= 1, "no episode kept both of its turns token-exact"
    _train(groups, tiny_model, weight_versions.dir_of(version), tmp_path)


def _train(groups, tiny_model, weights, tmp_path) -> None:
    """Two optimizer steps of the real learner (DeepSpeed, one CPU rank, in a child process) on the groups."""
    path = tmp_path / "groups.jsonl"
    path.write_text("\n".join(g.model_dump_json() for g in groups))
    script = f"""
import json, math, shutil
from pathlib import Path
from learner.batch import build_batch
from learner.engine import LearnerEngine
from services.wire import TrajectoryGroup
from tests.selfcheck import selfcheck_config
groups = [TrajectoryGroup.model_validate_json(line) for line in Path({str(path)!r}).read_text().splitlines()]
cfg = selfcheck_config(Path({str(tiny_model)!r}), {{"model": {{"max_model_len": 256}}, "loss": {{"filter_zero_variance": False}}}})
engine = LearnerEngine(cfg)
stats = [engine.train_step(build_batch(groups, cfg.loss, cfg.sampling.max_tokens)) for _ in range(2)]
print("STATS", json.dumps(stats))
engine.engine.destroy()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         cwd=str(tmp_path), env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    stats = json.loads(out.stdout.split("STATS", 1)[1].strip().splitlines()[0])
    assert len(stats) == 2 and all(math.isfinite(v) for s in stats for v in s.values() if isinstance(v, float))


def _env() -> dict:
    repo = str(Path(__file__).resolve().parents[3])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}


async def test_the_eval_client_relays_the_harness_to_chat_completions(rollout_server, sums_env, token_var):
    """verifiers' eval client (``vf-eval``'s) forwards the harness's OpenAI requests to ``/v1/chat/completions``
    as they are; the program gets the tandem fields back and the rubric scores the episode."""
    import verifiers.v1 as vf

    from rollout_server.verifiers_env import load_env

    env = load_env(sums_env, harness=sums_env)
    engine = rollout_server.app.state.engine
    ctx = vf.ModelContext(model=engine.model_dir.name,
                          client=vf.EvalClientConfig(base_url=f"{rollout_server.url}/v1", api_key_var=token_var),
                          sampling=vf.Sampling(max_tokens=8))
    task = list(env.taskset)[0]
    async with env.serving():
        [episode] = [await env.run_slot(slot, ctx) for slot in env.slots(task, 1)]
    assert episode.ok, episode.errors
    [trace] = episode.traces
    assert [n.message.role for n in trace.nodes] == ["user", "assistant", "tool", "assistant"]
    assert set(trace.rewards) == {"correct", "digits"}
    assert trace.calls and all(c.error is None for c in trace.calls)


async def test_a_reload_during_a_group_tags_it_with_the_version_it_started_on(rollout_server, sums_env, token_var,
                                                                               weight_versions):
    """verifiers keeps no version per turn: a group that a reload overtook is tagged with the version read before it
    started (a lower bound: judged staler than it may be, never fresher) and counted as inexact."""
    import asyncio

    import httpx

    from rollout_server.verifiers_env import VerifiersGroups, load_env

    env = load_env(sums_env, harness=sums_env)
    engine = rollout_server.app.state.engine
    before = engine.version
    new = weight_versions.make(seed=141)

    async def reload() -> None:
        await asyncio.sleep(0.5)  # the group's episodes are under way (a group takes seconds)
        async with httpx.AsyncClient(base_url=rollout_server.url, headers=rollout_server.headers, timeout=60) as c:
            r = await c.post("/v1/weights", json=new.model_dump())
            assert r.status_code == 200, r.text

    async with VerifiersGroups(env, base_url=f"{rollout_server.url}/v1", token_var=token_var,
                               model_dir=engine.model_dir, run_id="vf-test", sampling={"max_tokens": 10}) as source:
        group, _ = await asyncio.gather(source.group(list(env.taskset)[0], 3), reload())
        assert engine.version == new.version > before
        assert source.versions_inexact == 1
        assert group.policy_version == before
        assert all(s.policy_version == before and set(s.turn_versions) == {before} for s in group.samples)
        after = await source.group(list(env.taskset)[1], 2)
    assert source.versions_inexact == 1 and after.policy_version == new.version
