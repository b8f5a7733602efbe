"""The rollout server's cores, lent to the learner while that server waits for room (one machine, CPU).

On one machine the stack splits the cores between the two sides (``deploy.stack.cpu_split``): vLLM's
threads pinned to one half, the learner's torch threads on the rest. Where the learner is the slower side
(the 25m sizes of ``bench/e2e.py``), the rollout server spends much of each learner step waiting for
room (``bench/bubbles.py``: ``idle full``) and its cores idle, while TRL's synchronous step uses them all.
So while the learner is the slower side (it waited for data less than :data:`BOUND` of its time over the
last :data:`WINDOW` steps) and its steps are long (:data:`MIN_STEP_S`), before each micro-batch and before the optimizer step it looks whether any
group of the run is in flight (admitted and being generated: a ticket with a lease,
``broker.Admission``): none, and it runs on its own threads plus ``borrow`` more
(``torch.set_num_threads``); some, and on its own. One Redis ``ZCOUNT`` a look. A group admitted during a
micro-batch shares the cores until it ends. Where the rollout side is the slower one (the example: the
learner waits for data a tenth of its time) the learner never borrows: the cores it would take are the
ones the run waits on. Nor does it borrow for short steps: the example's 0.3 s step ran 1.27x faster on
two threads alone but cost 1.6x the CPU, and borrowing at every look there (its zero-variance groups
trained, so the learner was the slower side) made the run slower (docs/performance.md).
"""

from __future__ import annotations

import logging
from collections import deque

import redis
import torch

from broker import Keys

log = logging.getLogger("tandem.learner.cores")

WINDOW = 10
"""Steps over which the learner's data wait is judged."""
BOUND = 0.02
"""The learner is the slower side while it waited for data less than this share of its time."""
MIN_STEP_S = 1.0
"""Steps shorter than this on average over the window never borrow: a second thread pays too little on them."""


class BorrowedCores:
    """``apply()`` before each piece of a step sets the learner's torch threads (module docstring)."""

    def __init__(self, redis_url: str, keys: Keys, *, own: int, borrow: int) -> None:
        self.client = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.tickets, self.own, self.borrow = keys.tickets, own, borrow
        self.threads = own
        self.looks = self.lent = 0
        """Looks this step, and how many of them found the rollout side waiting (:meth:`lent_frac`)."""
        self._recent: deque[tuple[float, float]] = deque(maxlen=WINDOW)

    def step_ended(self, waited_s: float, busy_s: float) -> None:
        """One step of the learner: how long it waited for its data, and how long it worked."""
        self._recent.append((waited_s, busy_s))

    @property
    def learner_bound(self) -> bool:
        """Whether the learner waited for data less than :data:`BOUND` of its time over the last steps, and
        they took :data:`MIN_STEP_S` or longer on average."""
        waited, busy = sum(w for w, _ in self._recent), sum(b for _, b in self._recent)
        return (bool(self._recent) and waited < BOUND * (waited + busy)
                and busy >= MIN_STEP_S * len(self._recent))

    def apply(self) -> int:
        """The learner's threads for what comes next: all while the learner is the slower side and no group
        is in flight, its own otherwise."""
        in_flight = self._in_flight() if self.learner_bound else 1
        want = self.own if in_flight else self.own + self.borrow
        if want != self.threads:
            torch.set_num_threads(want)
            self.threads = want
        self.looks += 1
        self.lent += not in_flight
        return want

    def _in_flight(self) -> int:
        """Groups of the run admitted and being generated (1 when Redis does not answer)."""
        try:
            return self.client.zcount(self.tickets, "-inf", "(inf")  # queued tickets have score +inf
        except redis.RedisError as e:  # unknown: the learner's own cores
            log.warning("cannot read the run's tickets (%r): training on the learner's own cores", e)
            return 1

    def lent_frac(self) -> float | None:
        """The share of this step's looks that found the rollout side waiting; starts the next step's count."""
        frac = self.lent / self.looks if self.looks else None
        self.looks = self.lent = 0
        return frac

    def close(self) -> None:
        if self.threads != self.own:
            torch.set_num_threads(self.own)
        self.client.close()
