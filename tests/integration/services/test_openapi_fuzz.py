"""API fuzzing: requests generated from the services' own OpenAPI schemas, sent to real processes.

schemathesis turns each service's ``/openapi.json`` into hypothesis
strategies, requests that fit the schema (positive) and requests that break
it (negative), per operation; a fixed number of examples each keeps the file
near a minute. The servers are real: ``tandem serve control`` on the
session's Redis, and the session's reward server (bwrap sandbox).

Properties:

- with a token: no request gets a 5xx, nor a 401 (the token reaches the route), also
  with the path's ids fixed to a prompt set and a run that exist;
- prompt-set bodies of near-valid lines (hypothesis, every spec type): 201, or
  422 naming lines that exist;
- without a token, or with a wrong one: every operation in the schema
  answers 401, and so does every route outside it but ``/healthz`` (the one
  public route, ``services.security.PUBLIC_PATHS``). The one exception is the one
  ``services.security.Auth`` documents: FastAPI decodes a route's JSON body before
  it solves the auth dependency, so a body that is not JSON gets 400 or 422
  (a parse error; the route does not run).

A failure names the operation and gives the request as a curl command with
the response's status and body.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.fixtures.control import ARITH_LINES, TOKEN, run_config
from tests.fixtures.reward import REWARD_TOKEN

WRONG = {"Authorization": "Bearer not-the-token-of-this-service"}

EXAMPLES = 40
"""Examples per operation and generation mode with a token (fewer without one: every answer is 401) in
``make test``; ``make test-fast`` (which deselects ``slow``) sends a quarter of them (fixture ``examples``)."""
SLOW = {"POST /v1/execute": 15, "POST /v1/score": 25}
"""Operations that run code in the sandbox get fewer."""

OUTSIDE_SCHEMA = {
    "control": ["/", "/static/dashboard.js", "/v1/dashboard/charts", "/openapi.json", "/docs", "/redoc", "/metrics"],
    "reward": ["/openapi.json", "/docs", "/redoc", "/metrics"],
}


@pytest.fixture
def control_url(control_process) -> str:
    return control_process()


@pytest.fixture
def examples(request) -> int:
    """:data:`EXAMPLES`, or a quarter of it in a run that deselects ``slow`` tests (``make test-fast``, which
    has 3 minutes for everything: the whole count took a third of its wall time there)."""
    return EXAMPLES // 4 if "not slow" in request.config.getoption("markexpr") else EXAMPLES


def schema_of(url: str, token: str):
    raw = httpx.get(f"{url}/openapi.json", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert raw.status_code == 200, raw.text
    return schemathesis.openapi.from_dict(raw.json())


def fuzz(
    schema, url: str, headers: dict[str, str], problem: Callable[..., str | None], examples: int,
    known: dict[str, str] | None = None,
) -> list[str]:
    """Send ``examples`` generated requests per operation and mode; return the operations fuzzed.

    ``problem(case, status)`` says what is wrong with a response (None: nothing); the first
    problem fails the test with the request and the response. With ``known`` (path parameter ->
    an id that exists), only operations with such a parameter are fuzzed, with it fixed, so that
    requests get past the lookup.
    """
    fuzzed = []
    for result in schema.get_all_operations():
        operation = result.ok()
        count = min(examples, SLOW.get(operation.label, examples))
        fixed = {k: v for k, v in (known or {}).items() if f"{{{k}}}" in operation.path}
        if known is not None and not fixed:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=count, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate],
            )
            @given(case=operation.as_strategy(generation_mode=mode, path_parameters=fixed or None))
            def one(case) -> None:
                response = case.call(base_url=url, headers=headers, timeout=120)
                wrong = problem(case, response.status_code)
                if wrong:
                    raise AssertionError(
                        f"{case.operation.label}: {wrong}: got {response.status_code} "
                        f"{response.text[:500]!r}\n{case.as_curl_command(headers=headers, base_url=url)}"
                    )

            one()
        fuzzed.append(operation.label)
    return fuzzed


def server_error(case, status: int) -> str | None:
    if status >= 500:
        return "a server error"
    if status == 401:
        return "401 with a valid token"
    return None


def not_json(body: object) -> bool:
    if not isinstance(body, bytes | str):
        return False  # schemathesis serializes it as JSON
    try:
        json.loads(body)
    except ValueError:
        return True
    return False


def not_401(case, status: int) -> str | None:
    if status == 401:
        return None
    if status in (400, 422) and case.operation.method.upper() != "GET" and not_json(case.body):
        return None  # decoded before auth (services.security.Auth); the route did not run
    return "answered without a valid token"


def check_outside_schema(url: str, paths: list[str]) -> None:
    for path in paths:
        for headers in ({}, WRONG):
            r = httpx.get(f"{url}{path}", headers=headers, timeout=30, follow_redirects=False)
            assert r.status_code == 401, (path, headers, r.status_code, r.text[:200])
    assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200


@pytest.mark.slow
@pytest.mark.long  # over 25 s in make test (docs/testing.md): make test-long runs it
def test_control_plane_fuzz(control_url, examples):
    schema = schema_of(control_url, TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    fuzzed = fuzz(schema, control_url, auth, server_error, examples)
    assert len(fuzzed) >= 7 and "POST /v1/prompt-sets" in fuzzed and "POST /v1/runs" in fuzzed, fuzzed
    # again where the ids exist: the routes get past their lookups
    body = "".join(json.dumps(x) + "\n" for x in ARITH_LINES)
    set_id = httpx.post(f"{control_url}/v1/prompt-sets", content=body, headers=auth, timeout=30).json()["id"]
    run = httpx.post(f"{control_url}/v1/runs", json={"prompt_set_id": set_id, "config": run_config()}, headers=auth)
    assert run.status_code == 201, run.text
    known = {"set_id": set_id, "run_id": run.json()["run_id"]}
    assert set(fuzz(schema, control_url, auth, server_error, examples, known)) == {
        "GET /v1/prompt-sets/{set_id}", "DELETE /v1/prompt-sets/{set_id}", "GET /v1/runs/{run_id}",
        "GET /v1/runs/{run_id}/metrics", "GET /v1/runs/{run_id}/completions", "POST /v1/runs/{run_id}/stop"}
    for headers in ({}, WRONG):
        fuzz(schema, control_url, headers, not_401, max(2, examples // 4))
    check_outside_schema(control_url, OUTSIDE_SCHEMA["control"])


@pytest.mark.long  # over 12 s in make test (docs/testing.md): make test-long runs it
def test_reward_server_fuzz(reward_servers, examples):
    server = reward_servers["bwrap"]
    schema = schema_of(server.url, REWARD_TOKEN)
    fuzzed = fuzz(schema, server.url, server.headers, server_error, examples)
    assert set(fuzzed) >= {"POST /v1/score", "POST /v1/execute"}, fuzzed
    for headers in ({}, WRONG):
        fuzz(schema, server.url, headers, not_401, max(2, examples // 4))
    check_outside_schema(server.url, OUTSIDE_SCHEMA["reward"])


VALID = {
    "math": {"answer": "2"}, "exact": {"answer": "2"}, "numeric": {"answer": 2}, "regex": {"pattern": "a+"},
    "python_tests": {"tests": ["assert 1"]}, "judge": {},
    "combined": {"parts": [{"weight": 1, "spec": {"type": "exact", "answer": "1"}}]},
}
"""A valid line of each spec type, which the strategy below then changes a field or two of."""
FIELDS = ["prompt", "type", "answer", "extract", "pattern", "tests", "io", "parts", "tolerance", "limits", "url", "nope"]
TEXT = st.text(max_size=20) | st.sampled_from(["\ud800", "a\udfffb"])  # lone surrogates: json.dumps escapes them
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def spec_line(kind: str, prompt: str, changes: dict) -> bytes:
    return json.dumps({"prompt": prompt, "type": kind, **VALID[kind], **changes}).encode()  # NaN, Infinity too


SPEC_LINE = st.builds(
    spec_line, st.sampled_from(sorted(VALID)), TEXT, st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=1)
)
JUNK_LINE = JSON.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=40)
BODY = st.lists(SPEC_LINE, min_size=1, max_size=4) | st.lists(SPEC_LINE | JUNK_LINE, min_size=1, max_size=4)
"""Bodies of spec lines, half of them with junk lines among them."""


def test_prompt_set_bodies_fuzz(control_url, examples):
    """Prompt-set bodies from near-valid JSON lines (every spec type, wrong values, non-JSON, raw
    bytes): 201 with every line stored, or 422 naming lines that exist; never anything else."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=control_url, headers=auth, timeout=60) as client:

        @settings(max_examples=4 * examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @given(lines=BODY, default=st.sampled_from(sorted(set(VALID) - {"combined"})))
        def one(lines: list[bytes], default: str) -> None:
            body = b"\n".join(lines)
            r = client.post("/v1/prompt-sets", params={"default_type": default}, content=body)
            physical = body.count(b"\n") + 1
            if r.status_code == 201:
                info = client.get(f"/v1/prompt-sets/{r.json()['id']}").json()
                assert 1 <= info["count"] <= physical, (body, info)
                return
            assert r.status_code == 422, (body, r.status_code, r.text[:500])
            errors = r.json()["errors"]
            assert errors and all(0 <= e["line"] <= physical and "field" in e for e in errors), (body, errors)

        one()
