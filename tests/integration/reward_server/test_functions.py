"""Python reward functions through the real reward server: ``POST /v1/score`` and ``POST /v1/check``.

The functions live in a module written into a temporary folder that is put on the server's path, as an
operator would put one on ``PYTHONPATH``; the server's spawned workers import it.
"""

from __future__ import annotations

import json
import textwrap
import uuid

import pytest

TOKEN = "reward-functions-token"

MODULE = '''
import os, time
from pathlib import Path

def match(prompts, completions, solution, **kwargs):
    return [1.0 if c.strip() == s else 0.0 for c, s in zip(completions, solution)]

def batch_size(prompts, completions, **kwargs):
    return [len(completions)] * len(completions)

def prompt_length(prompts, completions, **kwargs):
    return [len(p) for p in prompts]

def scaled(prompts, completions, scale, offset=0.0, **kwargs):
    return [scale * len(c) + offset for c in completions]

def conversational(prompts, completions, **kwargs):
    return [float(p[-1]["role"] == "user" and c[0]["role"] == "assistant" and c[0]["content"] == "hi")
            for p, c in zip(prompts, completions)]

def parts(prompts, completions, **kwargs):
    return {"format": [0.5 if c.startswith("<") else 0.0 for c in completions],
            "length": [None if c == "skip" else 0.25 for c in completions]}

def maybe(prompts, completions, **kwargs):
    return [None if c.startswith("skip") else 1.0 for c in completions]

def raises(prompts, completions, **kwargs):
    raise ValueError("no solution column")

def wrong_length(prompts, completions, **kwargs):
    return [1.0]

def slow(prompts, completions, **kwargs):
    time.sleep(60)

def dies(prompts, completions, **kwargs):
    os._exit(3)

def exits(prompts, completions, **kwargs):
    raise SystemExit(4)
'''


@pytest.fixture
def rewards_module(tmp_path, monkeypatch) -> str:
    """A reward module on the path (the spawned workers inherit it), and a second one whose import
    leaves a mark, never allowed."""
    name = f"my_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODULE))
    (tmp_path / f"{name}_marks.py").write_text(
        f"from pathlib import Path\nPath({str(tmp_path / 'imported')!r}).write_text('x')\n"
        "def f(prompts, completions, **kwargs):\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def item(i, completion: str, spec: dict, prompt: str = "What is 6 x 7?") -> dict:
    return {"id": str(i), "prompt": prompt, "completion": completion, "spec": spec}


async def score(client, items: list[dict]) -> list[dict]:
    resp = await client.post("/v1/score", json={"items": items})
    assert resp.status_code == 200, resp.text
    return resp.json()["results"]


async def test_functions_score_batched_in_trls_shape(reward_app, rewards_module):
    m = rewards_module
    async with reward_app(sandbox="none", functions=[f"{m}:*"], function_timeout_s=20) as (_app, client):
        match = {"type": "python", "function": f"{m}:match", "solution": "42"}
        got = await score(client, [item(i, c, match) for i, c in enumerate(["42", " 42\n", "41", "forty-two"])])
        assert [(r["reward"], r["status"]) for r in got] == [(1.0, "ok"), (1.0, "ok"), (0.0, "ok"), (0.0, "ok")]

        # one call for the whole request (a group's G completions), each line's field a column
        per_line = [{"type": "python", "function": f"{m}:match", "solution": s} for s in ("1", "2", "3")]
        batched = [item(i, c, spec) for i, (c, spec) in enumerate(zip(["1", "5", "3"], per_line, strict=True))]
        batched += [item(10 + i, "x", {"type": "python", "function": f"{m}:batch_size"}) for i in range(5)]
        got = await score(client, batched)
        assert [r["reward"] for r in got] == [1.0, 0.0, 1.0] + [5.0] * 5

        # prompts, args (constants, as functools.partial would bind them), chat prompts
        got = await score(client, [
            item(0, "abc", {"type": "python", "function": f"{m}:prompt_length"}, prompt="12345"),
            item(1, "abcd", {"type": "python", "function": f"{m}:scaled", "args": {"scale": 0.5, "offset": 1}}),
            {"id": "2", "messages": [{"role": "user", "content": "hello"}], "completion": "hi",
             "spec": {"type": "python", "function": f"{m}:conversational"}},
        ])
        assert [r["reward"] for r in got] == [5.0, 3.0, 1.0]


async def test_components_none_and_weights(reward_app, rewards_module):
    m = rewards_module
    exact = {"type": "exact", "answer": "4"}
    async with reward_app(sandbox="none", functions=[f"{m}:*"]) as (_app, client):
        got = await score(client, [
            item(0, "<answer>4</answer>", {"type": "python", "function": f"{m}:parts"}),
            item(1, "skip", {"type": "python", "function": f"{m}:parts"}),
            # None: no reward from this part; the combined sum leaves it out, as TRL's does
            item(2, "skip <answer>4</answer>", {"type": "combined", "parts": [
                {"weight": 1.0, "spec": exact}, {"weight": 0.5, "spec": {"type": "python", "function": f"{m}:maybe"}}]}),
            item(3, "<answer>4</answer>", {"type": "combined", "parts": [
                {"weight": 1.0, "spec": exact}, {"weight": 0.5, "spec": {"type": "python", "function": f"{m}:maybe"}}]}),
            # no part gave a reward: 0, said so
            item(4, "skip", {"type": "python", "function": f"{m}:maybe"}),
        ])
    assert (got[0]["reward"], got[0]["components"]) == (0.75, {"format": 0.5, "length": 0.25})
    assert (got[1]["reward"], got[1]["components"]) == (0.0, {"format": 0.0})
    assert (got[2]["reward"], got[2]["status"]) == (1.0, "ok") and "python=none" in got[2]["detail"]
    assert got[3]["reward"] == 1.5
    assert (got[4]["reward"], got[4]["status"]) == (0.0, "no_answer") and "returned None" in got[4]["detail"]


async def test_failures_are_reward_errors_never_scores(reward_app, rewards_module):
    m = rewards_module
    async with reward_app(sandbox="none", functions=[f"{m}:*"], function_timeout_s=1.5) as (_app, client):
        got = await score(client, [
            item(0, "a", {"type": "python", "function": f"{m}:raises"}),
            item(1, "a", {"type": "python", "function": f"{m}:wrong_length"}),
            item(2, "b", {"type": "python", "function": f"{m}:wrong_length"}),
            item(3, "a", {"type": "python", "function": f"{m}:slow"}),
            item(4, "a", {"type": "python", "function": f"{m}:dies"}),
            item(5, "a", {"type": "combined", "parts": [  # one failed part fails the whole reward
                {"weight": 1.0, "spec": {"type": "exact", "answer": "a", "extract": "whole"}},
                {"weight": 1.0, "spec": {"type": "python", "function": f"{m}:raises"}}]}),
            item(6, "a", {"type": "python", "function": f"{m}:exits"}),  # the function's exit, not the server's
        ])
        assert all(r["status"] == "reward_error" and r["reward"] is None for r in got), got
        details = [r["detail"] for r in got]
        assert "ValueError: no solution column" in details[0] and f"{m}.py" in details[0]
        assert "has 1 values for 2 completions" in details[1] == details[2]
        assert "took over 1.5 s" in details[3]
        assert "worker died" in details[4]
        assert "python=reward_error" in details[5]
        assert "SystemExit: 4" in details[6]
        # the pool replaced what it killed: the server still scores
        ok = await score(client, [item(0, "42", {"type": "python", "function": f"{m}:match", "solution": "42"})])
        assert ok[0]["reward"] == 1.0


async def test_unknown_or_disallowed_functions_are_refused_naming_them(reward_app, rewards_module, tmp_path):
    m = rewards_module
    nested = {"type": "combined", "parts": [{"weight": 1, "spec": {"type": "exact", "answer": "x"}},
                                            {"weight": 1, "spec": {"type": "python", "function": f"{m}_marks:f"}}]}
    async with reward_app(sandbox="none") as (_app, client):  # the default: nothing may be called
        resp = await client.post("/v1/score", json={"items": [item(0, "a", {"type": "python", "function": f"{m}:match"})]})
        assert resp.status_code == 422
        assert f"items.0.spec.function: {m}:match is not allowed" in resp.json()["detail"]
        assert "none: the setting is empty" in resp.json()["detail"]
    async with reward_app(sandbox="none", functions=[f"{m}:*", "json:loads"]) as (_app, client):
        resp = await client.post("/v1/score", json={"items": [
            item(0, "a", {"type": "python", "function": f"{m}:match", "solution": "a"}), item(1, "a", nested)]})
        assert resp.status_code == 422
        assert resp.json()["errors"][0]["loc"] == ["body", "items", 1, "spec", "parts", 1, "spec", "function"]
        assert f"{m}_marks:f is not allowed" in resp.json()["detail"]
        for function, why in [(f"{m}:nope", f"module {m} has no 'nope'"), (f"{m}:os", "not a function defined in"),
                              ("json:loads", "json:loads(s, *")]:
            resp = await client.post("/v1/check", json={"functions": [function]})
            assert resp.status_code == 200
            verdict = resp.json()
            assert why in (verdict["refused"].get(function) or verdict["allowed"].get(function)), verdict
        resp = await client.post("/v1/check", json={"functions": [f"{m}:match", f"{m}_marks:f", f"{m}:nope"],
                                                    "keywords": {f"{m}:match": ["solution"]}})
        assert resp.json()["allowed"] == {f"{m}:match": f"{m}:match(prompts, completions, solution, **kwargs)"}
        assert set(resp.json()["refused"]) == {f"{m}_marks:f", f"{m}:nope"}
        resp = await client.post("/v1/check", json={"functions": ["os.system"]})
        assert resp.status_code == 422
    assert not (tmp_path / "imported").exists()  # a refused module is never imported


def test_tandem_serve_reward_takes_the_allow_list_and_the_path_from_its_environment(tmp_path, rewards_module):
    """As an operator runs it: ``tandem serve reward`` in a process of its own, the module on its
    PYTHONPATH, the allow-list a JSON list in TANDEM_REWARD_FUNCTIONS."""
    import os
    import subprocess
    import sys

    import httpx

    from deploy.stack import wait_healthy
    from host.processes import free_port, stop_group
    from tests.fixtures.reward import REPO

    port, log = free_port(), tmp_path / "reward.log"
    env = {**os.environ, "TANDEM_TOKEN": TOKEN, "TANDEM_REWARD_SANDBOX": "none", "TANDEM_LOG_LEVEL": "warning",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
           "TANDEM_REWARD_FUNCTIONS": json.dumps([f"{rewards_module}:match"])}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "reward", "--port", str(port)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 90, log)
        spec = {"type": "python", "function": f"{rewards_module}:match", "solution": "42"}
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as client:
            got = client.post("/v1/score", json={"items": [item(0, "42", spec), item(1, "7", spec)]})
            assert [r["reward"] for r in got.json()["results"]] == [1.0, 0.0], got.text
            other = client.post("/v1/check", json={"functions": [f"{rewards_module}:batch_size"]}).json()
            assert "not allowed" in other["refused"][f"{rewards_module}:batch_size"]  # only the one named
    finally:
        stop_group(proc)

