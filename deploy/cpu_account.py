"""A run's CPU account: the CPU-seconds of every process the stack runs, by service, from the run's start.

The stack's supervision loop (``tandem run``, ``tandem up``: :meth:`deploy.stack.Stack.check`) calls
:meth:`CpuAccountant.record`. Every ``every_s`` it reads each service's processes (``host.cpu``):
a rollout server with its vLLM engine core, the learner with torchrun's ranks, the reward server
with its sandboxes, the control plane, the embedded Redis, and the supervisor itself (``stack``).
Each process is found by the owner tag the stack gives it (``host.processes.owners``), so what a
service started is counted as that service's, whatever process group it moved to. For the run the
stack works on (``ACTIVE_RUN``) it writes

- ``Keys.cpu``: the account since the stack first saw the run (``services.wire.CpuAccount``), which
  ``GET /v1/runs/{id}`` returns with its figures per trained sample, ``tandem status`` prints and
  the main job puts in ``summary.json``;
- a ``cpu`` span on the ``stack`` service's ``cpu`` track per interval, its attributes service ->
  CPU-seconds in the interval, which ``tandem trace`` draws as a counter of cores in use per service.

docs/performance.md, "Where the CPU goes", reads an account.
"""

from __future__ import annotations

import logging
import resource
import time
from collections import defaultdict

import redis

from broker.keys import ACTIVE_RUN, Keys
from host.cpu import CpuMeter, descendants
from host.processes import owners
from services.timeline import MAXLEN, Span
from services.wire import CpuAccount, ServiceCpu

log = logging.getLogger("tandem.cpu")

EVERY_S = 5.0
"""How often the stack reads its processes: one pass over ``/proc`` (a few milliseconds)."""


def own_cpu_s() -> float:
    """CPU-seconds of this process (every thread), without its children (the services: counted apart)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


Reading = dict[str, dict[str, float]]
"""service -> process name -> CPU-seconds since the stack started it."""


def minus(now: Reading, base: Reading) -> Reading:
    return {service: {name: max(0.0, s - base.get(service, {}).get(name, 0.0)) for name, s in procs.items()}
            for service, procs in now.items()}


class CpuAccountant:
    """Reads the stack's processes and keeps the account of the run it works on (see the module)."""

    def __init__(self, stack, every_s: float = EVERY_S) -> None:
        self.stack = stack
        self.every_s = every_s
        self._meters: dict[str, CpuMeter] = defaultdict(CpuMeter)
        self._next = 0.0
        self._client: redis.Redis | None = None
        self._run: str | None = None
        self._base: Reading = {}  # the reading when the run was first seen
        self._prev: tuple[float, Reading] | None = None  # the last reading, for the interval's span

    def read(self) -> Reading:
        """Every service's processes now, by process name (the departed of each service included)."""
        prefix = self.stack._owner_tag() + "/"
        pids: dict[str, set[int]] = defaultdict(set)
        for pid, tag in owners(self.stack._owner_tag()).items():  # what left its service's process tree too
            if tag.startswith(prefix):
                pids[tag[len(prefix):].split("/")[0]].add(pid)
        for name, child in list(self.stack.children.items()):  # what rewrote its environment (a process title)
            if child.proc is not None and child.proc.poll() is None:
                pids[name] |= descendants([child.proc.pid])
        if self.stack.redis is not None and self.stack.redis.proc is not None:
            pids["redis"].add(self.stack.redis.proc.pid)
        for service in self._meters:  # a service with no process left keeps its figure
            pids.setdefault(service, set())
        out = {service: self._meters[service].sample(found) for service, found in pids.items()}
        out["stack"] = {"stack": own_cpu_s()}
        return out

    def record(self, run_id: str | None = None, *, force: bool = False) -> CpuAccount | None:
        """Every ``every_s`` (now with ``force``): read, and write the account of ``run_id`` (default: the
        active run) to Redis. Returns the account written, or None. Never raises for Redis: a reading that
        cannot be written is retried at the next one."""
        now = time.monotonic()
        if not force and now < self._next:
            return None
        self._next = now + self.every_s
        reading, at = self.read(), time.time()
        try:
            client = self._connect()
            run = run_id or _text(client.get(ACTIVE_RUN))
            if run is None:
                self._prev = (at, reading)
                return None
            if run != self._run:  # a new run: its account starts at the last reading before it was seen
                self._run = run
                self._prev = self._prev or (at, reading)
                self._base = self._prev[1]
            account = CpuAccount(at=at, services={
                service: ServiceCpu(cpu_s=round(sum(procs.values()), 3),
                                    processes={n: round(s, 3) for n, s in sorted(procs.items())})
                for service, procs in sorted(minus(reading, self._base).items())})
            keys = Keys(run)
            pipe = client.pipeline(transaction=False)
            pipe.set(keys.cpu, account.model_dump_json())
            if self._prev is not None:
                t0, before = self._prev
                interval = {service: round(sum(procs.values()), 3) for service, procs in minus(reading, before).items()}
                pipe.xadd(keys.timeline, Span("cpu", "stack", "cpu", t0, at, interval).fields(), maxlen=MAXLEN,
                          approximate=True)
            pipe.execute()
        except redis.RedisError as e:
            log.warning("the CPU account could not be written: %r", e)
            self._client = None
            return None
        self._prev = (at, reading)
        return account

    def _connect(self) -> redis.Redis:
        if self._client is None:
            self._client = redis.Redis.from_url(self.stack.redis_url, socket_timeout=5.0, socket_connect_timeout=5.0)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _text(value) -> str | None:
    return value.decode() if isinstance(value, bytes) else value
