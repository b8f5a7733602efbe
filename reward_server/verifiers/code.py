"""``python_tests`` reward: the completion's program against assert tests and stdin/stdout cases.

One sandbox job per completion: the assert tests run through the harness
(``sandbox/guest/harness.py``, one verdict per test, reported as each
finishes), and every stdin/stdout case is a run of its own. Reward is the
fraction of passed tests and cases, or all-or-nothing (``reward_mode="all"``).
The status is ``ok`` when everything passed, else the first failure found
(``compile_error``, ``timeout``, ``memory_limit``, ``output_limit``,
``runtime_error``) or ``wrong_answer``.

Verdicts the completion cannot forge: the harness is a trusted process that
never runs the program. The program runs in a child without the results
pipe, the tests or their expected values; the harness executes each test in
its own interpreter, calls the program's functions through a pipe, and gets
back only plain data rebuilt in exact builtin types, so comparisons are the
harness's, never the program's. The tests reach the harness on its stdin,
never as a file. Early exits, fake result lines, rigged ``__eq__``, patched
``json``/``builtins``/``unittest``, stack and ``gc`` inspection and reading
the tests are closed (the harness docstring lists them, and
tests/integration/reward_server/test_hacks.py tries each under every backend).
Residual risks: the program sees its call arguments (inputs in the prompt
can be hard-coded); the stdin/stdout cases still compare the program's own
output, which is as intended; expected stdout never enters the sandbox.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from reward_server.extract import code as extract_code
from reward_server.sandbox.base import Job, RunOutcome, SandboxError, harness_run, python_run
from reward_server.verifiers.result import infra, scored
from services.reward_specs import PythonTestsSpec
from services.wire import ScoreResult

RunJob = Callable[[Job], Awaitable[list[RunOutcome]]]
FAILURE_ORDER = ("compile_error", "timeout", "memory_limit", "output_limit", "runtime_error")


def same_output(got: str, want: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines."""
    return [x.rstrip() for x in got.rstrip().splitlines()] == [x.rstrip() for x in want.rstrip().splitlines()]


def build_job(program: str, spec: PythonTestsSpec, python: str) -> Job:
    runs = [harness_run(python, spec.tests, spec.limits.wall_s)] if spec.tests else []
    runs += [python_run(python, "solution.py", stdin=case.stdin) for case in spec.io]
    return Job(files={"solution.py": program}, runs=runs, limits=spec.limits)


def judge(spec: PythonTestsSpec, outcomes: list[RunOutcome]) -> tuple[float, str, str]:
    """(reward, status, detail) from the runs of :func:`build_job`."""
    passed, notes, failures = 0, [], []
    runs = iter(outcomes)
    if spec.tests:
        harness = next(runs)
        verdicts = {r.get("i"): r for r in harness.results or [] if isinstance(r, dict)}
        for i in range(len(spec.tests)):
            verdict = verdicts.get(i)
            if verdict is not None and verdict.get("ok") is True:
                passed += 1
            elif verdict is not None:
                notes.append(f"test {i}: {verdict.get('error', '')}"[:200])
                failures.append(verdict.get("status"))  # the harness's per-test status (timeout, ...)
        if harness.status != "ok":
            failures.append(harness.status)
            notes.append(f"tests: {harness.status}: {harness.detail}"[:300])
    for i, (case, outcome) in enumerate(zip(spec.io, runs, strict=True)):
        if outcome.status != "ok":
            failures.append(outcome.status)
            notes.append(f"io {i}: {outcome.status}: {outcome.detail}"[:300])
        elif same_output(outcome.stdout, case.stdout):
            passed += 1
        else:
            notes.append(f"io {i}: output differs")
    total = len(spec.tests) + len(spec.io)
    fraction = passed / total
    reward = fraction if spec.reward_mode == "fraction" else float(passed == total)
    if passed == total:
        return reward, "ok", ""
    status = next((s for s in FAILURE_ORDER if s in failures), "wrong_answer")
    return reward, status, f"{passed}/{total} passed; " + "; ".join(notes[:8])


async def score(item_id: str, completion: str, spec: PythonTestsSpec, run_job: RunJob, python: str) -> ScoreResult:
    program = extract_code(completion, spec.extract)
    if program is None:
        return scored(item_id, 0.0, "no_answer", f"no program found ({spec.extract})")
    try:
        outcomes = await run_job(build_job(program, spec, python))
    except SandboxError as e:
        return infra(item_id, "sandbox_error", str(e))
    reward, status, detail = judge(spec, outcomes)
    return scored(item_id, reward, status, detail)
