"""TRL's own reward functions (``trl.rewards``, TRL 1.16) through ``POST /v1/score``, compared with calling them
as TRL's ``GRPOTrainer._calculate_rewards`` does: the same prompts, completions, ``completion_ids``, dataset
columns and ``trainer_state``, and an ``async def`` function, which TRL awaits.

The factories are built in a module of the user's, as TRL's documentation builds them, and each is allowed by
name in the reward server's allow-list (``TANDEM_REWARD_FUNCTIONS``).
"""

from __future__ import annotations

import asyncio
import importlib
import textwrap
import uuid
from types import SimpleNamespace

import pytest

pytest.importorskip("trl")

MODULE = '''
import asyncio
from trl.rewards import (accuracy_reward, get_cosine_scaled_reward, get_repetition_penalty_reward,
                         get_soft_overlong_punishment, reasoning_accuracy_reward, think_format_reward)

cosine = get_cosine_scaled_reward(max_len=12)
repetition = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
overlong = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=6)

async def schedule(prompts, completions, completion_ids, trainer_state, log_metric, **kwargs):
    """Shaped by training progress, as TRL's documentation suggests, and logging a metric."""
    await asyncio.sleep(0.05)
    log_metric("schedule_progress", trainer_state.global_step / trainer_state.max_steps)
    return [len(ids) * trainer_state.global_step / trainer_state.max_steps + trainer_state.epoch
            for ids in completion_ids]
'''
FUNCTIONS = ["accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "cosine", "repetition",
             "overlong", "schedule"]

PROMPT = [{"role": "user", "content": "What is 6 x 7? Think first."}]
COMPLETIONS = ["<think>\n6 x 7 is 42.\n</think>\nSo \\boxed{42}", "<think>guess</think> \\boxed{41}", "42 42 42 42",
               "no think tags at all: $\\boxed{\\frac{84}{2}}$", "</think>\\boxed{42}"]
COMPLETION_IDS = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2], [3, 3, 3, 3],
                  list(range(20)), [4, 5, 4, 5, 6]]
SOLUTION = "$42$"
STATE = {"global_step": 3, "max_steps": 8, "epoch": 1.0}


@pytest.fixture
def trl_module(tmp_path, monkeypatch) -> str:
    name = f"my_trl_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def trls_own(module: str, function: str) -> tuple[list[float | None], dict[str, list], dict[str, list[float]]]:
    """What TRL's trainer gets from ``function``: its call with TRL's keywords, awaited when async."""
    extra, metrics = {}, {}
    fn = getattr(importlib.import_module(module), function)
    out = fn(prompts=[PROMPT] * len(COMPLETIONS),
             completions=[[{"role": "assistant", "content": c}] for c in COMPLETIONS],
             completion_ids=COMPLETION_IDS, solution=[SOLUTION] * len(COMPLETIONS),
             trainer_state=SimpleNamespace(**STATE),
             log_extra=lambda column, values: extra.setdefault(column, []).extend(values),
             log_metric=lambda name, value: metrics.setdefault(name, []).append(value))
    if asyncio.iscoroutine(out):
        out = asyncio.run(out)
    return list(out), extra, metrics


async def in_a_thread(name: str, args: tuple) -> object:
    """A ``functions_runner`` that runs the worker's entry in a thread of this process (on Modal the runner is
    a Restricted Function's call: ``deploy.modal_app._run_functions``)."""
    from reward_server.verifiers import function_worker

    return await asyncio.to_thread(getattr(function_worker, name), *args)


@pytest.mark.parametrize("runner", [None, in_a_thread], ids=["worker pool", "functions_runner"])
async def test_trls_reward_functions_give_through_tandem_what_they_give_in_trl(reward_app, trl_module, runner):
    allowed = [f"{trl_module}:{f}" for f in FUNCTIONS]
    async with reward_app(sandbox="none", functions=allowed, functions_runner=runner) as (_app, client):
        checked = (await client.post("/v1/check", json={"functions": allowed,
                                                        "keywords": {f: ["solution"] for f in allowed}})).json()
        assert checked["refused"] == {}, checked
        for function in FUNCTIONS:
            spec = {"type": "python", "function": f"{trl_module}:{function}", "solution": SOLUTION}
            items = [{"id": str(i), "messages": PROMPT, "completion": c, "completion_ids": ids, "spec": spec}
                     for i, (c, ids) in enumerate(zip(COMPLETIONS, COMPLETION_IDS, strict=True))]
            resp = await client.post("/v1/score", json={"items": items, "trainer_state": STATE})
            assert resp.status_code == 200, resp.text
            results = resp.json()["results"]
            expected, extra, metrics = await asyncio.to_thread(trls_own, trl_module, function)
            # TRL's None (no reward: NaN in its sum) is tandem's 0 with status no_answer
            got = [None if r["status"] == "no_answer" and r["detail"].startswith("no reward") else r["reward"]
                   for r in results]
            assert got == expected, (function, [r["detail"] for r in results])
            assert len(set(expected)) > 1, (function, expected)  # the completions tell its rewards apart
            assert [r["logged"] for r in results] == [{k: v[i] for k, v in extra.items()}
                                                      for i in range(len(COMPLETIONS))], function
            assert resp.json()["metrics"] == {k: sum(v) / len(v) for k, v in metrics.items()}, function


async def test_async_functions_of_one_request_are_awaited_together(reward_app, trl_module):
    """Two async calls in one request (a combined spec of two parts) share one worker and its event loop."""
    function = f"{trl_module}:schedule"
    spec = {"type": "combined", "parts": [
        {"weight": 1.0, "spec": {"type": "python", "function": function}},
        {"weight": 2.0, "spec": {"type": "python", "function": function, "args": {"unused": 1}}}]}
    async with reward_app(sandbox="none", functions=[function], function_workers=1) as (_app, client):
        resp = await client.post("/v1/score", json={"trainer_state": STATE, "items": [
            {"id": "0", "prompt": "p", "completion": "c", "completion_ids": [1, 2, 3, 4], "spec": spec}]})
        assert resp.status_code == 200, resp.text
        assert resp.json()["results"][0]["reward"] == pytest.approx(3 * (4 * 3 / 8 + 1.0))


async def test_check_refuses_a_required_parameter_tandem_does_not_pass_naming_it(reward_app, trl_module):
    """TRL's accuracy_reward needs a ``solution`` column: refused for lines without one, allowed with one;
    TRL's own keywords (completion_ids, trainer_state, ...) are always passed."""
    accuracy, cosine = f"{trl_module}:accuracy_reward", f"{trl_module}:cosine"
    async with reward_app(sandbox="none", functions=[accuracy, cosine]) as (_app, client):
        without = (await client.post("/v1/check", json={"functions": [accuracy, cosine]})).json()
        assert "requires 'solution', which tandem does not pass" in without["refused"][accuracy]
        assert "requires 'solution'" in without["refused"][cosine]  # completion_ids is passed: not named
        given = (await client.post("/v1/check", json={"functions": [accuracy, cosine],
                                                      "keywords": {accuracy: ["solution"], cosine: ["solution"]}})).json()
        assert given["refused"] == {} and set(given["allowed"]) == {accuracy, cosine}
        resp = await client.post("/v1/score", json={"items": [
            {"id": "0", "prompt": "p", "completion": "42", "spec": {"type": "python", "function": accuracy}}]})
        assert resp.status_code == 422
        assert resp.json()["errors"][0]["loc"] == ["body", "items", 0, "spec", "function"]
        assert "requires 'solution'" in resp.json()["detail"]
