"""The learner's side of the trajectories stream (rank 0 only).

Reads trajectory groups, and for each optimizer step hands the trainer
``groups_per_step`` groups that pass, in this order:

1. *decode*: a payload that is not a valid :class:`TrajectoryGroup`
   (wrong logprob length, bad reward, ...) is dead-lettered with the
   validation error as its reason;
2. *check*: token ids beyond the model's vocabulary, a sequence longer than
   its context, or a group of another run are dead-lettered with a reason;
3. *signal*: with ``loss.filter_zero_variance`` a group whose rewards are all
   equal is acknowledged as ``zero_variance_dropped`` (DAPO dynamic
   sampling: the batch is filled with groups that carry a gradient);
4. *acceptance* (ARCHITECTURE.md section 3), judged when the step's batch is
   formed, against the version the step will improve: a group from version
   ``v`` is used only if ``0 <= v_learner - v <= max_staleness``; otherwise it
   is acknowledged as ``stale_dropped``.

Groups are held in an ordered buffer keyed by group id, so a redelivery of
a group already held (its visibility timeout ran out while it waited) is not
trained twice; the broker itself skips group ids already acknowledged.
Accepted groups are acknowledged by the trainer only after their step (and
the publish it triggers) is done: the admission tickets they hold keep
rollout servers from starting groups that would be stale on arrival.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict

import redis.asyncio as aioredis

from broker import Delivery, Keys, Stream, accept
from learner.batch import check_group, group_has_signal
from services.config import RunConfig
from services.wire import TrajectoryGroup, decode_delivery


class DataTimeout(Exception):
    """No usable trajectory arrived within ``learner.wait_timeout_s``."""


class Feeder:
    """Accepted, validated, de-duplicated trajectory groups, a step's worth at a time."""

    def __init__(
        self, redis: aioredis.Redis, keys: Keys, cfg: RunConfig, *, vocab_size: int, max_len: int, consumer: str
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.consumer = consumer
        st = cfg.staleness
        self.stream = Stream.trajectories(
            redis, keys, visibility_timeout_s=st.visibility_timeout_s, max_deliveries=st.max_deliveries
        )
        self.buffer: OrderedDict[str, tuple[Delivery, TrajectoryGroup]] = OrderedDict()
        self.counts: Counter[str] = Counter()
        self.idle_s = 0.0

    async def start(self) -> int:
        """Create the consumer group and take over entries a previous learner left pending.

        The learner is the only reader of its consumer group, so whatever is
        pending at start-up belongs to a learner that died: it is claimed at
        once (visibility timeout 0) instead of after the normal timeout.
        Returns how many entries were taken over.
        """
        await self.stream.ensure_group()
        takeover = Stream.trajectories(
            self.redis, self.keys, visibility_timeout_s=0.0, max_deliveries=self.cfg.staleness.max_deliveries
        )
        pending = await takeover.pending()
        if not pending:
            return 0
        # one read claims them all (XAUTOCLAIM from the start of the pending list)
        got = await takeover.read(self.consumer, count=pending, block_ms=None)
        await self._admit(got)
        return len(got)

    async def _admit(self, deliveries: list[Delivery]) -> None:
        for d in deliveries:
            gid = d.envelope.group_id
            if gid in self.buffer:
                continue  # a redelivery of a group this learner already holds
            group = await decode_delivery(self.stream, d, TrajectoryGroup)
            if group is None:  # dead-lettered with the validation error as its reason
                self.counts["dead_lettered"] += 1
                continue
            reason = check_group(group, self.vocab_size, self.max_len)
            if reason is None and group.run_id != self.keys.run_id:
                reason = f"group of run {group.run_id!r} on run {self.keys.run_id!r}'s stream"
            if reason is None and group.group_id != gid:
                reason = f"envelope group id {gid!r} differs from the payload's {group.group_id!r}"
            if reason is not None:
                await self.stream.dead_letter(d, reason)
                self.counts["dead_lettered"] += 1
                continue
            if self.cfg.loss.filter_zero_variance and not group_has_signal(group):
                await self.stream.ack([d], counter="zero_variance_dropped")
                self.counts["zero_variance_dropped"] += 1
                continue
            self.buffer[gid] = (d, group)

    async def drop_stale(self, v_learner: int) -> int:
        """Acknowledge and count every buffered group the acceptance rule refuses now."""
        eta = self.cfg.staleness.max_staleness
        stale = [gid for gid, (_d, g) in self.buffer.items() if not accept(v_learner, g.policy_version, eta)]
        if stale:
            await self.stream.ack([self.buffer.pop(gid)[0] for gid in stale], counter="stale_dropped")
            self.counts["stale_dropped"] += len(stale)
        return len(stale)

    async def next_batch(
        self, v_learner: int, want: int, timeout_s: float, stop: threading.Event | None = None
    ) -> list[tuple[Delivery, TrajectoryGroup]] | None:
        """``want`` groups acceptable for the step that produces ``v_learner + 1`` (oldest first).

        Returns None if ``stop`` is set while waiting. Raises
        :class:`DataTimeout` when the buffer has not filled for ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if stop is not None and stop.is_set():
                return None
            await self.drop_stale(v_learner)
            if len(self.buffer) >= want:
                return [self.buffer.popitem(last=False)[1] for _ in range(want)]
            left = deadline - time.monotonic()
            if left <= 0:
                raise DataTimeout(
                    f"no usable trajectory group for {timeout_s:.0f} s "
                    f"({len(self.buffer)} of {want} buffered for version {v_learner})"
                )
            t0 = time.monotonic()
            got = await self.stream.read(self.consumer, count=want - len(self.buffer), block_ms=int(min(1.0, left) * 1000))
            self.idle_s += time.monotonic() - t0
            await self._admit(got)

    async def ack_trained(self, deliveries: list[Delivery]) -> None:
        """The step using ``deliveries`` is done: mark their groups done (never trained again)."""
        await self.stream.ack(deliveries, counter="accepted")
