"""Load test: the real services on loopback under bounded, concurrent load (issue 13, item 5).

Starts an embedded Redis and, each as ``python -m deploy.cli serve NAME``
on a free port in its own process group, the reward server (the default
sandbox backend: gVisor when runsc works, else bubblewrap), the control plane
and a rollout server on a tiny Qwen3 built in code; then runs four loads:

- ``score``: ``POST /v1/score``, one ``python_tests`` item per request, half
  of them hostile (infinite loop, fork bomb, memory hog, 100 MB of stdout,
  sleep past the limit) among correct and incorrect programs; every verdict
  is checked (a correct program scores 1, the rest 0, never an
  infrastructure failure);
- ``generate``: ``POST /v1/generate`` on the tiny model;
- ``upload``: ``POST /v1/prompt-sets``, a different set per request;
- ``poll``: dashboard clients polling ``/v1/runs``, ``/v1/runs/{id}`` and
  its metrics.

The services run with small, explicit capacities, so that the loads fill
them: the reward server 2 workers and 16 queued jobs, the rollout server 64
pending sequences, the control plane its defaults. A load is ``clients``
coroutines each sending ``per_client`` requests one after the other; a client refused with 429/503 waits its ``Retry-After``
(at most ``RETRY_CAP_S``) before its next request, as tandem's own clients
do. Nothing is retried: every answer is counted. The table gives per load
the answers by status, throughput, and p50/p99 latency of all answers and
of the 2xx ones.

The loads run twice. Round 1, all four at once, fills every pool to what
this concurrency needs; round 2 runs each load on its own, then all at
once, and is what the table shows. Around round 2 it takes a census of
every service process and its children: processes, open file descriptors
(``/proc/PID/fd``), and for the reward server the sandboxes alive (runsc or
bwrap sandbox processes, its cgroups) and the temporary directories it made
(it gets a ``TMPDIR`` of its own). Any growth from before round 2 to after
it (once the counts settle, at most ``--settle`` seconds) is a leak: it
grew with the number of requests. Pools are counted apart and checked
against their bounds: the control plane's Redis connections (and Redis's
clients), gVisor's ptrace stub processes, the fds inside sandboxes. Every
service must still answer ``/healthz`` 200 (Redis: PING).

    python bench/load.py [--quick] [--out bench/results/load.json]

``tests/integration/bench/test_load.py`` runs a short version of the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
from redis.exceptions import RedisError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deploy.stack import wait_healthy  # noqa: E402
from host.processes import die_with_parent, free_port, stop_groups  # noqa: E402

RETRY_CAP_S = 10.0
"""Longest a client waits on a Retry-After before its next request."""
HOSTILE_LIMITS = {"wall_s": 2.0, "cpu_s": 2.0, "memory_mb": 256, "processes": 32, "output_bytes": 1 << 20}
TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
PROGRAMS: dict[str, tuple[str, float]] = {
    # name: (program, the reward it must get)
    "correct": ("def add(a, b):\n    return a + b\n", 1.0),
    "incorrect": ("def add(a, b):\n    return a - b\n", 0.0),
    "infinite_loop": ("while True:\n    pass\n", 0.0),
    "fork_bomb": ("import os\nwhile True:\n    os.fork()\n", 0.0),
    "memory_hog": ("x = []\nwhile True:\n    x.append(bytearray(50 << 20))\n", 0.0),
    "huge_stdout": ("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))\n", 0.0),
    "sleep": ("import time\ntime.sleep(60)\n", 0.0),
}
MIX = ["correct", "infinite_loop", "incorrect", "fork_bomb", "correct", "memory_hog",
       "incorrect", "huge_stdout", "correct", "sleep"]
"""Programs in the order requests cycle through them: half hostile."""
REFUSED = (429, 503)


# -- loads ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """``clients`` coroutines, each sending ``per_client`` requests in turn."""

    name: str
    clients: int
    per_client: int

    @property
    def requests(self) -> int:
        return self.clients * self.per_client


FULL = (Load("score", 200, 2), Load("generate", 100, 2), Load("upload", 20, 2), Load("poll", 50, 10))
QUICK = (Load("score", 40, 1), Load("generate", 20, 1), Load("upload", 5, 1), Load("poll", 10, 3))


@dataclass
class Answer:
    status: int | None
    """HTTP status; None: no answer (connection error, timeout)."""
    latency_s: float
    retry_after: str | None = None
    problem: str = ""
    """For answers that are neither 2xx nor a refusal, or a wrong verdict: what came back."""


@dataclass
class Result:
    load: str
    requests: int
    clients: int
    wall_s: float
    answers: list[Answer] = field(default_factory=list)

    def count(self, what: str) -> int:
        if what == "ok":
            return sum(1 for a in self.answers if a.status is not None and 200 <= a.status < 300)
        if what == "other":
            return sum(1 for a in self.answers
                       if a.status is None or not (200 <= a.status < 300 or a.status in REFUSED))
        return sum(1 for a in self.answers if a.status == int(what))

    @property
    def refused_without_retry_after(self) -> int:
        return sum(1 for a in self.answers if a.status in REFUSED and not a.retry_after)

    @property
    def problems(self) -> list[str]:
        return [a.problem for a in self.answers if a.problem]

    def summary(self) -> dict:
        def pct(xs: list[float], q: float) -> float | None:
            xs = sorted(xs)
            return round(xs[min(len(xs) - 1, round(q * (len(xs) - 1)))], 3) if xs else None

        every = [a.latency_s for a in self.answers]
        ok = [a.latency_s for a in self.answers if a.status is not None and 200 <= a.status < 300]
        return {
            "load": self.load, "requests": self.requests, "clients": self.clients,
            "ok": self.count("ok"), "429": self.count("429"), "503": self.count("503"), "other": self.count("other"),
            "refused_without_retry_after": self.refused_without_retry_after,
            "wall_s": round(self.wall_s, 2),
            "req_per_s": round(len(every) / self.wall_s, 2), "ok_per_s": round(len(ok) / self.wall_s, 2),
            "p50_s": pct(every, 0.5), "p99_s": pct(every, 0.99),
            "ok_p50_s": pct(ok, 0.5), "ok_p99_s": pct(ok, 0.99),
            "problems": self.problems[:10],
        }


Send = Callable[[httpx.AsyncClient, int], Awaitable[Answer]]


async def run_load(load: Load, client: httpx.AsyncClient, send: Send) -> Result:
    """``load`` against ``client``'s service: request ``i`` is ``send(client, i)``."""
    result = Result(load.name, load.requests, load.clients, 0.0)

    async def one_client(c: int) -> None:
        for k in range(load.per_client):
            answer = await send(client, c * load.per_client + k)
            result.answers.append(answer)
            if answer.status in REFUSED and answer.retry_after and k + 1 < load.per_client:
                await asyncio.sleep(min(RETRY_CAP_S, float(answer.retry_after)))

    start = time.perf_counter()
    await asyncio.gather(*(one_client(c) for c in range(load.clients)))
    result.wall_s = time.perf_counter() - start
    return result


async def timed(request: Awaitable[httpx.Response], check: Callable[[httpx.Response], str] | None = None) -> Answer:
    """Send one request; an Answer with its status, latency, Retry-After, and any problem with it."""
    start = time.perf_counter()
    try:
        resp = await request
    except httpx.HTTPError as e:
        cause = e.__cause__ or e.__context__
        return Answer(None, time.perf_counter() - start, problem=f"{type(e).__name__}: {e} ({cause!r})"[:300])
    latency = time.perf_counter() - start
    problem = ""
    if 200 <= resp.status_code < 300:
        problem = check(resp) if check else ""
    elif resp.status_code not in REFUSED:
        problem = f"{resp.status_code}: {resp.text[:300]}"
    return Answer(resp.status_code, latency, resp.headers.get("retry-after"), problem)


def score_body(i: int) -> tuple[dict, str]:
    kind = MIX[i % len(MIX)]
    spec = {"type": "python_tests", "tests": TESTS, "extract": "whole", "limits": HOSTILE_LIMITS}
    return {"items": [{"id": f"{kind}-{i}", "completion": PROGRAMS[kind][0], "spec": spec}]}, kind


async def send_score(client: httpx.AsyncClient, i: int) -> Answer:
    body, kind = score_body(i)

    def check(resp: httpx.Response) -> str:
        (result,) = resp.json()["results"]
        want = PROGRAMS[kind][1]
        if result["reward"] == want:
            return ""
        return f"{kind}: reward {result['reward']} ({result['status']}: {result['detail'][:300]}), want {want}"

    return await timed(client.post("/v1/score", json=body), check)


async def send_generate(client: httpx.AsyncClient, i: int) -> Answer:
    body = {"prompt": f"{i % 50}+{i % 7}=", "n": 1, "max_tokens": 16, "temperature": 1.0, "seed": i}

    def check(resp: httpx.Response) -> str:
        samples = resp.json()["samples"]
        return "" if len(samples) == 1 and samples[0]["token_ids"] else f"generate: bad samples {samples!r}"[:300]

    return await timed(client.post("/v1/generate", json=body), check)


def prompt_set(i: int, lines: int) -> bytes:
    """A prompt set of ``lines`` arithmetic lines, different for every ``i``."""
    return b"".join(
        json.dumps({"prompt": f"{i}:{j}+{j % 97}=", "type": "exact", "answer": str(j + j % 97),
                    "extract": "answer_tag"}).encode() + b"\n"
        for j in range(lines)
    )


def sender_upload(lines: int) -> Send:
    async def send(client: httpx.AsyncClient, i: int) -> Answer:
        body = prompt_set(secrets.randbits(48) * 1000 + i, lines)
        return await timed(client.post("/v1/prompt-sets", content=body,
                                       headers={"Content-Type": "application/x-ndjson"}))

    return send


def sender_poll(run_id: str) -> Send:
    paths = ("/v1/runs", f"/v1/runs/{run_id}", f"/v1/runs/{run_id}/metrics")

    async def send(client: httpx.AsyncClient, i: int) -> Answer:
        return await timed(client.get(paths[i % len(paths)]))

    return send


# -- services ------------------------------------------------------------------------------------


@dataclass
class Service:
    name: str
    url: str
    token: str
    pid: int | None
    """The service's process (its children are counted with it); None: in this process, not counted."""
    tmpdir: Path | None = None
    """The reward server's TMPDIR: every temporary directory it made is in there."""
    proc: subprocess.Popen | None = None

    def client(self, connections: int) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=180,
            # a connection per request: a reused one can be closed under a request, by uvicorn's keep-alive
            # timeout or by httpx's own pool at high concurrency (encode/httpx#3348), and the bench would
            # count the client's race as the service's failure
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=0),
        )


def spawn(name: str, workdir: Path, env: dict[str, str], args: tuple[str, ...] = (),
          timeout_s: float = 120) -> Service:
    """``python -m deploy.cli serve NAME`` on a free port in its own process group, healthy.

    The environment is this one without its ``TANDEM_*`` and ``REDIS_URL``, plus a new token, a run
    directory under ``workdir`` and ``env``."""
    port = free_port()
    token = secrets.token_hex(16)
    run_dir = workdir / f"run-{name}"
    run_dir.mkdir(mode=0o700, exist_ok=True)
    full = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "REDIS_URL"}
    full.update({"TANDEM_TOKEN": token, "TANDEM_LOG_LEVEL": "warning", "TANDEM_RUN_DIR": str(run_dir),
                 "PYTHONPATH": str(ROOT), **env})
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "serve", name, "--port", str(port), *args],
            cwd=ROOT, env=full, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout_s, log)
    except BaseException:
        stop_groups([proc], 10)
        raise
    return Service(name, url, token, proc.pid, Path(env["TMPDIR"]) if "TMPDIR" in env else None, proc)


def start_reward(workdir: Path, *, sandbox: str = "auto", workers: int = 2, max_queued: int = 16) -> Service:
    tmp = workdir / "reward-tmp"
    tmp.mkdir(mode=0o755)
    return spawn("reward", workdir, {"TMPDIR": str(tmp), "TANDEM_REWARD_SANDBOX": sandbox,
                                     "TANDEM_REWARD_WORKERS": str(workers),
                                     "TANDEM_REWARD_MAX_QUEUED": str(max_queued)})


def start_control(workdir: Path, redis_url: str, model: Path, env: dict[str, str] | None = None) -> Service:
    """The control plane, allowed to start runs on ``model`` (it lies outside its run directory)."""
    return spawn("control", workdir, {"REDIS_URL": redis_url,
                                      "TANDEM_CONTROL_MODEL_DIRS": json.dumps([str(Path(model).resolve().parent)]),
                                      **(env or {})})


def start_rollout(workdir: Path, model: Path, max_pending_seqs: int = 64) -> Service:
    return spawn("rollout", workdir, {"TANDEM_ROLLOUT_KV_CACHE_GIB": "0.25", "TANDEM_ROLLOUT_MAX_MODEL_LEN": "256",
                                      "TANDEM_ROLLOUT_DTYPE": "float32",
                                      "TANDEM_ROLLOUT_MAX_PENDING_SEQS": str(max_pending_seqs)},
                 ("--model", str(model)), timeout_s=300)


async def create_run(control: Service, model: Path) -> str:
    """A prompt set and a run on it, for the pollers to read."""
    config = {"name": "load", "model": {"path": str(model), "max_model_len": 64},
              "data": {"train": "/dev/null", "epochs": 1}, "sampling": {"group_size": 4, "max_tokens": 16},
              "learner": {"groups_per_step": 2, "steps": 5}, "staleness": {"max_staleness": 1}}
    async with control.client(2) as c:
        resp = await c.post("/v1/prompt-sets", content=prompt_set(-1, 20),
                            headers={"Content-Type": "application/x-ndjson"})
        resp.raise_for_status()
        resp = await c.post("/v1/runs", json={"prompt_set_id": resp.json()["id"], "config": config})
        resp.raise_for_status()
        return resp.json()["run_id"]


@dataclass
class Targets:
    reward: Service
    rollout: Service
    control: Service
    redis: Service
    """The control plane's embedded Redis (``url`` with its password; no token)."""
    run_id: str
    upload_lines: int = 2000

    def plan(self, load: Load) -> tuple[Service, Send]:
        return {
            "score": (self.reward, send_score),
            "generate": (self.rollout, send_generate),
            "upload": (self.control, sender_upload(self.upload_lines)),
            "poll": (self.control, sender_poll(self.run_id)),
        }[load.name]

    @property
    def services(self) -> list[Service]:
        return [self.reward, self.rollout, self.control, self.redis]


@contextlib.asynccontextmanager
async def started(model: Path, *, sandbox: str = "auto", rollout: Service | None = None) -> AsyncIterator[Targets]:
    """Redis, the reward server, the control plane and (unless ``rollout`` is given: tests pass the session's)
    a rollout server on ``model``, all under a temporary directory; every process is stopped at the end."""
    from broker.embedded import EmbeddedRedis

    with tempfile.TemporaryDirectory(prefix="tandem-load-") as tmp:
        workdir = Path(tmp)
        os.chmod(workdir, 0o755)  # the reward server's TMPDIR is inside: its sandboxes reach their bundles
        redis = EmbeddedRedis(workdir / "redis").start()
        procs: list[subprocess.Popen] = []
        try:
            reward = start_reward(workdir, sandbox=sandbox)
            procs.append(reward.proc)
            control = start_control(workdir, redis.url, model)
            procs.append(control.proc)
            if rollout is None:
                rollout = start_rollout(workdir, model)
                procs.append(rollout.proc)
            run_id = await create_run(control, model)
            yield Targets(reward, rollout, control, Service("redis", redis.url, "", redis.proc.pid), run_id)
        finally:
            stop_groups(procs, 30)
            redis.stop()


# -- census --------------------------------------------------------------------------------------


def _fds(pid: int) -> int:
    with contextlib.suppress(FileNotFoundError, ProcessLookupError, PermissionError):
        return len(os.listdir(f"/proc/{pid}/fd"))
    return 0


def _cmd0(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        cmd = p.cmdline()
        return cmd[0] if cmd else ""
    return ""


def _is_stub(p: psutil.Process) -> bool:
    """A stub process of gVisor's ptrace platform (no command line, under a runsc sandbox): one per guest
    address space, kept by runsc for reuse, so their number follows the largest job, not the job count."""
    with contextlib.suppress(psutil.Error):
        return p.name() == "exe" and not p.cmdline()
    return False


def _cgroups(pid: int) -> int:
    """tandem's cgroups that process ``pid`` made (``tandem-KIND-PID-N``; one hierarchy counted)."""
    from reward_server.sandbox import cgroup

    v = cgroup.version()
    if v is None:
        return 0
    top = cgroup.ROOT if v == 2 else cgroup.ROOT / "pids"
    return sum(1 for d in top.glob(f"tandem-*-{pid}-*") if not d.name.startswith("tandem-probe-"))


def _redis_clients(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        return int(client.info("clients")["connected_clients"]) - 1  # not this one
    finally:
        client.close()


def _sandboxed(tree: list[psutil.Process]) -> set[int]:
    """Pids of sandbox processes in ``tree``: each ``runsc``/``bwrap`` process and everything under it."""
    roots = [p for p in tree if os.path.basename(_cmd0(p)) in ("runsc", "bwrap")]
    found = {p.pid for p in roots}
    for root in roots:
        with contextlib.suppress(psutil.Error):
            found.update(c.pid for c in root.children(recursive=True))
    return found


def _sockets_to(pid: int, port: int) -> int:
    with contextlib.suppress(psutil.Error):
        return sum(1 for c in psutil.Process(pid).net_connections("tcp") if c.raddr and c.raddr.port == port)
    return 0


def census(services: list[Service]) -> dict[str, dict[str, int]]:
    """Per service: processes of it and its children, and the open fds of its own processes.

    Reward server: also the sandboxes alive (runsc/bwrap sandbox processes, cgroups), the temporary
    directories it made, and (pools, see :data:`POOLED`) gVisor's stub processes (not in ``processes``)
    and the fds held inside sandboxes (gVisor's sentry and gofer: they vary by one or two as a sandbox
    is replaced). Control plane: its Redis connections apart from its fds. Redis: its clients apart."""
    out: dict[str, dict[str, int]] = {}
    redis_port = next((urlsplit(s.url).port for s in services if s.url.startswith("redis")), None)
    for s in services:
        if s.pid is None:
            continue
        try:
            top = psutil.Process(s.pid)
            tree = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        stubs = {p.pid for p in tree if _is_stub(p)}
        procs = [p for p in tree if p.pid not in stubs]
        inside = _sandboxed(procs)
        row = {"processes": len(procs), "fds": sum(_fds(p.pid) for p in procs if p.pid not in inside)}
        if s.tmpdir is not None:
            row["sandboxes"] = sum(1 for p in procs if _cmd0(p) == "runsc-sandbox" or _cmd0(p).endswith("bwrap"))
            row["sandbox_cgroups"] = _cgroups(s.pid)
            row["temp_dirs"] = len(list(s.tmpdir.iterdir()))
            row["gvisor_stubs"] = len(stubs)
            row["sandbox_fds"] = sum(_fds(pid) for pid in inside)
        if s.url.startswith("redis"):
            row["clients"] = _redis_clients(s.url)
            row["fds"] -= row["clients"]
        elif redis_port is not None and (held := _sockets_to(s.pid, redis_port)):
            row["redis_connections"] = held
            row["fds"] -= held
        out[s.name] = row
    return out


POOLED = frozenset({"gvisor_stubs", "sandbox_fds", "redis_connections", "clients"})
"""Census counts that are pools: they grow with concurrency up to a bound, not with the number of
requests, so they are checked against the bound (:func:`pool_bounds`) rather than for growth."""


def pool_bounds(row: dict[str, int]) -> dict[str, int]:
    """The most each pool in a census row may hold: gVisor keeps one stub per guest address space, so
    per sandbox one per process a job may have, plus the agent, the zygote and the harness's own; the
    control plane holds at most ``REDIS_CONNECTIONS`` Redis connections (Redis: those, plus one
    client of this census)."""
    from control_plane.app import REDIS_CONNECTIONS

    return {"gvisor_stubs": row.get("sandboxes", 0) * (HOSTILE_LIMITS["processes"] + 8),
            "redis_connections": REDIS_CONNECTIONS, "clients": REDIS_CONNECTIONS + 1}


def growth(before: dict, after: dict) -> dict[str, dict[str, int]]:
    """Counts that went up, per service (pools left out): the leaks."""
    return {name: up for name, row in after.items()
            if (up := {k: v - before[name][k] for k, v in row.items()
                       if k not in POOLED and v > before.get(name, {}).get(k, v)})}


async def settled(services: list[Service], before: dict, settle_s: float) -> dict:
    """The census once nothing is above ``before`` any more, or after ``settle_s``."""
    deadline = time.monotonic() + settle_s
    while True:
        now = await asyncio.to_thread(census, services)
        if not growth(before, now) or time.monotonic() > deadline:
            return now
        await asyncio.sleep(1.0)


async def healthz(services: list[Service]) -> dict[str, int | str]:
    """``/healthz`` of every service (Redis: 200 when it answers PING)."""
    from broker import connect

    out: dict[str, int | str] = {}
    async with httpx.AsyncClient(timeout=30) as c:
        for s in services:
            try:
                if s.url.startswith("redis"):
                    redis = connect(s.url)
                    try:
                        out[s.name] = 200 if await redis.ping() else "no PONG"
                    finally:
                        await redis.aclose()
                else:
                    out[s.name] = (await c.get(f"{s.url}/healthz")).status_code
            except (httpx.HTTPError, OSError, RedisError) as e:
                out[s.name] = f"{type(e).__name__}: {e}"
    return out


async def backend(reward: Service) -> str:
    """The sandbox backend the reward server ran its jobs in (from its ``/metrics``)."""
    async with reward.client(1) as c:
        text = (await c.get("/metrics")).text
    return ", ".join(sorted(set(re.findall(r'reward_exec_seconds_count\{backend="([^"]+)"', text)))) or "none"


# -- the run -------------------------------------------------------------------------------------


async def one(targets: Targets, load: Load, label: str | None = None) -> Result:
    service, send = targets.plan(load)
    async with service.client(load.clients) as client:
        result = await run_load(load, client, send)
    result.load = label or load.name
    return result


async def together(targets: Targets, loads: tuple[Load, ...], label: str) -> list[Result]:
    return list(await asyncio.gather(*(one(targets, load, f"{load.name} ({label})") for load in loads)))


async def measure(targets: Targets, loads: tuple[Load, ...], *, settle_s: float = 30.0) -> dict:
    """The loads twice, census between and after.

    Round 1, all loads at once, fills every pool to what this concurrency needs (the control plane's
    Redis connections, runsc's stubs); the census ``before`` follows it. Round 2 runs each load on its
    own, then all at once; the census ``after`` follows it, once the counts settle. Growth from
    ``before`` to ``after`` grows with the number of requests, not with their concurrency: a leak.
    """
    fresh = await asyncio.to_thread(census, targets.services)
    first = await together(targets, loads, "round 1, all at once")
    await asyncio.sleep(min(3.0, settle_s))
    before = await asyncio.to_thread(census, targets.services)
    results = [await one(targets, load) for load in loads]
    results += await together(targets, loads, "all at once")
    after = await settled(targets.services, before, settle_s)
    return {"results": [r.summary() for r in results], "round_1": [r.summary() for r in first],
            "census_fresh": fresh, "census_before": before, "census_after": after,
            "leaks": growth(before, after),
            "healthz": await healthz(targets.services)}


def table(rows: list[dict]) -> str:
    head = (f"{'load':<24} {'requests':>8} {'clients':>7} {'ok':>5} {'429':>5} {'503':>5} {'other':>5} "
            f"{'req/s':>7} {'ok/s':>7} {'p50 s':>7} {'p99 s':>7} {'ok p50':>7} {'ok p99':>7}")
    lines = [head]
    for r in rows:
        fmt = {k: ("-" if r[k] is None else f"{r[k]:.3f}") for k in ("p50_s", "p99_s", "ok_p50_s", "ok_p99_s")}
        lines.append(f"{r['load']:<24} {r['requests']:>8} {r['clients']:>7} {r['ok']:>5} {r['429']:>5} "
                     f"{r['503']:>5} {r['other']:>5} {r['req_per_s']:>7.2f} {r['ok_per_s']:>7.2f} "
                     f"{fmt['p50_s']:>7} {fmt['p99_s']:>7} {fmt['ok_p50_s']:>7} {fmt['ok_p99_s']:>7}")
    return "\n".join(lines)


def verdict(report: dict) -> list[str]:
    """What failed: answers other than 2xx/429/503, refusals without Retry-After, wrong verdicts,
    unhealthy services, leaks, more gVisor stubs than the jobs' process limit explains."""
    problems = []
    for r in report["round_1"] + report["results"]:
        if r["other"]:
            problems.append(f"{r['load']}: {r['other']} answers neither 2xx nor 429/503: {r['problems'][:3]}")
        elif r["problems"]:
            problems.append(f"{r['load']}: wrong answers: {r['problems'][:3]}")
        if r["refused_without_retry_after"]:
            problems.append(f"{r['load']}: {r['refused_without_retry_after']} 429/503 without Retry-After")
    problems += [f"{name}: /healthz {status}" for name, status in report["healthz"].items() if status != 200]
    problems += [f"leak in {name}: {up}" for name, up in report["leaks"].items()]
    for name, row in report["census_after"].items():
        for pool, bound in pool_bounds(row).items():
            if row.get(pool, 0) > bound:
                problems.append(f"{name}: {pool} = {row[pool]}, above its bound {bound}")
    return problems


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small version (about a minute)")
    parser.add_argument("--sandbox", default="auto", help="TANDEM_REWARD_SANDBOX of the reward server")
    parser.add_argument("--settle", type=float, default=30.0, help="seconds the census may take to settle")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/load.json")
    args = parser.parse_args()
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    print(f"command: {command}", flush=True)
    loads = QUICK if args.quick else FULL

    from examples.tiny import tiny_qwen3

    with tempfile.TemporaryDirectory(prefix="tandem-load-model-") as tmp:
        model = tiny_qwen3(Path(tmp) / "tiny-qwen3", seed=0)
        started_at = time.perf_counter()
        async with started(model, sandbox=args.sandbox) as targets:
            report = await measure(targets, loads, settle_s=args.settle)
            sandbox = await backend(targets.reward)
        took = time.perf_counter() - started_at
    report.update(command=command, took_s=round(took, 1), cpu_cores=os.cpu_count(),
                  loads=[asdict(x) for x in loads], reward_sandbox=sandbox)
    report["problems"] = verdict(report)
    print(f"\nreward server's sandbox: {sandbox}; {os.cpu_count()} CPU cores; {took:.0f} s "
          "in all (round 1, all at once, not shown: it fills the pools)")
    print(table(report["results"]))
    for key in ("census_fresh", "census_before", "census_after", "leaks", "healthz"):
        print(f"{key + ':':<15} {json.dumps(report[key])}")
    for problem in report["problems"]:
        print("PROBLEM:", problem)
    if not report["problems"]:
        print("every answer 2xx, 429 or 503; every refusal with Retry-After; healthy after; no leaks")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
