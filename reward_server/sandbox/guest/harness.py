"""Run a solution, then assert-style tests against it, one verdict per test.

Usage: python3 -I harness.py SOLUTION.py TESTS.json RESULTS_FD

The solution is executed once in a namespace named ``solution`` (so an
``if __name__ == "__main__"`` block does not run); each test is then executed
in that namespace. After every test one line ``{"i": N, "ok": bool,
"error": str}`` is written to RESULTS_FD at once, so the verdicts reached
before a timeout survive it.

The tests run in the solution's process: a program written to subvert the
harness (e.g. by writing to the results descriptor) can, as in every
in-process harness. Cross-submission isolation does not depend on it.
"""

import json
import os
import sys
import traceback
import types

COMPILE_ERROR_EXIT = 97


def main() -> None:
    solution_path, tests_path, results_fd = sys.argv[1], sys.argv[2], int(sys.argv[3])
    out = os.fdopen(results_fd, "w", buffering=1)
    with open(tests_path, encoding="utf-8") as f:
        tests = json.load(f)
    with open(solution_path, encoding="utf-8", errors="replace") as f:
        source = f.read()
    try:
        code = compile(source, solution_path, "exec")
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError):
        traceback.print_exc(limit=0)
        sys.stderr.flush()
        sys.exit(COMPILE_ERROR_EXIT)
    module = types.ModuleType("solution")
    module.__file__ = solution_path
    sys.modules["solution"] = module
    namespace = module.__dict__
    exec(code, namespace)  # an exception here fails every test: the process exits non-zero
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"<test {i}>", "exec"), namespace)
            record = {"i": i, "ok": True, "error": ""}
        except AssertionError:
            record = {"i": i, "ok": False, "error": "AssertionError"}
        except Exception as e:  # noqa: BLE001 - any exception in a test is that test's failure
            record = {"i": i, "ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        out.write(json.dumps(record) + "\n")
    out.flush()
    sys.stdout.flush()
    # Exit status 0 even when a test failed: failures are reported per test, not as a crash.
    os._exit(0)


if __name__ == "__main__":
    main()
