"""``POST /v1/score`` end to end: every verifier through the real server (gVisor sandbox)."""

from __future__ import annotations

import contextlib

import pytest
from fastapi import FastAPI

FENCED_DOUBLE = "Here you go:\n```python\ndef double(x):\n    return 2 * x\n```\n"
TESTS = ["assert double(1) == 2", "assert double(0) == 0", "assert double(-3) == -6", "assert double(10) == 20"]


async def score(server, items: list[dict]) -> list[dict]:
    async with server.client() as client:
        resp = await client.post("/v1/score", json={"items": items})
    assert resp.status_code == 200, resp.text
    results = resp.json()["results"]
    assert [r["id"] for r in results] == [i["id"] for i in items]  # request order
    return results


@pytest.fixture
def gvisor_server(reward_servers):
    return reward_servers["gvisor"]


async def test_math(gvisor_server):
    spec = {"type": "math", "answer": "\\frac{1}{2}"}
    items = [
        {"id": "tag", "completion": "so <answer>0.5</answer>", "spec": spec},
        {"id": "latex", "completion": "<answer>\\frac{2}{4}</answer>", "spec": spec},
        {"id": "boxed", "completion": "thus \\boxed{1/2}", "spec": {**spec, "extract": "boxed"}},
        {"id": "wrong", "completion": "<answer>0.6</answer>", "spec": spec},
        {"id": "none", "completion": "I do not know", "spec": spec},
        {"id": "sqrt", "completion": "<answer>2\\sqrt{2}</answer>", "spec": {"type": "math", "answer": "\\sqrt{8}"}},
    ]
    got = {r["id"]: (r["reward"], r["status"]) for r in await score(gvisor_server, items)}
    assert got == {"tag": (1.0, "ok"), "latex": (1.0, "ok"), "boxed": (1.0, "ok"), "wrong": (0.0, "wrong_answer"),
                   "none": (0.0, "no_answer"), "sqrt": (1.0, "ok")}


async def test_format_rewards_and_combinations(gvisor_server):
    fmt = {"type": "regex", "pattern": r"<think>.*</think>\s*<answer>.*</answer>", "mode": "search"}
    items = [
        {"id": "exact", "completion": "<answer> Paris </answer>", "spec": {"type": "exact", "answer": "paris", "case_sensitive": False}},
        {"id": "exact-no", "completion": "<answer>Lyon</answer>", "spec": {"type": "exact", "answer": "Paris"}},
        {"id": "num", "completion": "total: 1,000.4", "spec": {"type": "numeric", "answer": 1000, "tolerance": 0.5}},
        {"id": "num-rel", "completion": "about 105", "spec": {"type": "numeric", "answer": 100, "tolerance": 0.01, "relative": True}},
        {"id": "regex", "completion": "<think>hm</think> <answer>3</answer>", "spec": fmt},
        {"id": "regex-no", "completion": "<answer>3</answer>", "spec": fmt},
        {"id": "combined", "completion": "<answer>7</answer>", "spec": {"type": "combined", "parts": [
            {"weight": 0.8, "spec": {"type": "exact", "answer": "8"}},
            {"weight": 0.2, "spec": {"type": "regex", "pattern": "<answer>.*</answer>"}}]}},
    ]
    got = {r["id"]: (r["reward"], r["status"]) for r in await score(gvisor_server, items)}
    assert got["exact"] == (1.0, "ok") and got["exact-no"] == (0.0, "wrong_answer")
    assert got["num"] == (1.0, "ok") and got["num-rel"] == (0.0, "wrong_answer")
    assert got["regex"] == (1.0, "ok") and got["regex-no"] == (0.0, "wrong_answer")
    assert got["combined"][0] == pytest.approx(0.2) and got["combined"][1] == "wrong_answer"


async def test_python_tests(gvisor_server):
    half = "```python\ndef double(x):\n    return 2 * x if x > 0 else 1\n```"
    io_spec = {"type": "python_tests", "io": [{"stdin": "2 3\n", "stdout": "5"}, {"stdin": "10 -4\n", "stdout": "6\n"}]}
    items = [
        {"id": "right", "completion": FENCED_DOUBLE, "spec": {"type": "python_tests", "tests": TESTS}},
        {"id": "half", "completion": half, "spec": {"type": "python_tests", "tests": TESTS}},
        {"id": "half-all", "completion": half, "spec": {"type": "python_tests", "tests": TESTS, "reward_mode": "all"}},
        {"id": "syntax", "completion": "```python\ndef double(x) return x\n```", "spec": {"type": "python_tests", "tests": TESTS}},
        {"id": "crash", "completion": "```python\nraise SystemExit(3)\n```", "spec": {"type": "python_tests", "tests": TESTS}},
        {"id": "no-code", "completion": "double it", "spec": {"type": "python_tests", "tests": TESTS}},
        {"id": "io", "completion": "```python\na, b = map(int, input().split())\nprint(a + b)\n```", "spec": io_spec},
        {"id": "io-wrong", "completion": "```python\nprint(5)\n```", "spec": io_spec},
        {"id": "slow", "completion": "```python\ndef double(x):\n    while x == 10:\n        pass\n    return 2 * x\n```",
         "spec": {"type": "python_tests", "tests": TESTS, "limits": {"wall_s": 1.5, "cpu_s": 1.5}}},
    ]
    got = {r["id"]: r for r in await score(gvisor_server, items)}
    assert (got["right"]["reward"], got["right"]["status"]) == (1.0, "ok")
    assert (got["half"]["reward"], got["half"]["status"]) == (0.5, "wrong_answer")
    assert got["half-all"]["reward"] == 0.0
    assert (got["syntax"]["reward"], got["syntax"]["status"]) == (0.0, "compile_error")
    assert (got["crash"]["reward"], got["crash"]["status"]) == (0.0, "runtime_error")
    assert (got["no-code"]["reward"], got["no-code"]["status"]) == (0.0, "no_answer")
    assert (got["io"]["reward"], got["io"]["status"]) == (1.0, "ok")
    assert (got["io-wrong"]["reward"], got["io-wrong"]["status"]) == (0.5, "wrong_answer")
    # The verdicts reached before the timeout count: 3 of 4 tests passed.
    assert (got["slow"]["reward"], got["slow"]["status"]) == (0.75, "timeout")


async def test_python_tests_verdicts_cannot_be_forged(gvisor_server):
    # The three hacks found by hand against the shipped server: fake verdict lines then os._exit(0),
    # an object equal to everything, a patched json.dumps. Each scored 1.0 with the in-process harness.
    fake = "".join(f'{{"i": {i}, "ok": true}}\n' for i in range(4))
    hacks = {
        "fake-lines": f"import os\nfor fd in range(3, 16):\n    try:\n        os.write(fd, {fake!r}.encode())\n"
                      "    except OSError:\n        pass\nos._exit(0)\n",
        "always-equal": "class E:\n    def __eq__(self, other):\n        return True\ndef double(x):\n    return E()\n",
        "json": "import json\n_d = json.dumps\njson.dumps = lambda o, *a, **k: _d(dict(o, ok=True) if isinstance(o, dict) "
                "and 'ok' in o else o, *a, **k)\ndef double(x):\n    return 0\n",
    }
    spec = {"type": "python_tests", "tests": TESTS[:1] + TESTS[2:], "extract": "whole"}
    items = [{"id": "honest", "completion": FENCED_DOUBLE, "spec": {**spec, "extract": "fenced"}}]
    items += [{"id": name, "completion": program, "spec": spec} for name, program in hacks.items()]
    got = {r["id"]: (r["reward"], r["status"]) for r in await score(gvisor_server, items)}
    assert got["honest"] == (1.0, "ok"), got
    assert all(got[name][0] == 0.0 and got[name][1] != "ok" for name in hacks), got


def scripted_judge_app() -> FastAPI:
    """A stand-in OpenAI-compatible judge (named as such): scores 8 if the answer says 'Paris'."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict) -> dict:
        prompt = body["messages"][-1]["content"]
        if "BROKEN" in prompt:
            return {"choices": [{"message": {"content": "I refuse to grade."}}]}
        verdict = "Score: 8" if "Paris" in prompt.split("Answer:")[-1] else "Score: 2"
        return {"choices": [{"message": {"role": "assistant", "content": f"Reasoning... {verdict}"}}]}

    return app


@contextlib.asynccontextmanager
async def serve_judge():
    import asyncio

    import uvicorn

    from host.processes import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(scripted_judge_app(), host="127.0.0.1", port=port, log_level="warning"))
    server.install_signal_handlers = lambda: None  # the test run owns the signal handlers
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def test_judge(reward_app):
    # A spec may name only an allow-listed judge URL (test_judge.py); here the server's own judge serves.
    spec = {"type": "judge", "prompt": "Capital of France?", "reference": "Paris"}
    items = [
        {"id": "good", "completion": "It is Paris.", "spec": spec},
        {"id": "bad", "completion": "It is Lyon.", "spec": spec},
        {"id": "unparsable", "completion": "BROKEN", "spec": spec},
    ]
    async with serve_judge() as url, reward_app(sandbox="none", judge_url=url) as (_app, client):
        resp = await client.post("/v1/score", json={"items": items})
        got = {r["id"]: (r["reward"], r["status"]) for r in resp.json()["results"]}
    async with reward_app(sandbox="none", judge_url="http://127.0.0.1:9") as (_app, client):
        resp = await client.post("/v1/score", json={"items": [{"id": "down", "completion": "Paris", "spec": spec}]})
        got.update({r["id"]: (r["reward"], r["status"]) for r in resp.json()["results"]})
    assert got["good"] == (0.8, "ok") and got["bad"] == (0.2, "ok")
    assert got["unparsable"] == (None, "judge_error") and got["down"] == (None, "judge_error")
