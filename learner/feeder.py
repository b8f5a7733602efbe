"""The learner's side of the trajectories stream (rank 0 only).

Reads trajectory groups, and for each optimizer step hands the trainer
``groups_per_step`` groups that pass, in this order:

1. *decode*: a payload that is not a valid :class:`TrajectoryGroup`
   (wrong logprob length, bad reward, ...) is dead-lettered with the
   validation error as its reason;
2. *check*: token ids beyond the model's vocabulary, a sequence longer than
   its context, a group of another run, or one whose log-probs are not of the
   distribution the run samples from (``raw_logprobs`` at a temperature other
   than 1: ``SamplingConfig.logprobs_refusal``) are dead-lettered with a reason;
3. *signal*: with ``loss.filter_zero_variance`` a group whose rewards are all
   equal is acknowledged as ``zero_variance_dropped`` (DAPO dynamic
   sampling: the batch is filled with groups that carry a gradient);
4. *acceptance* (docs/architecture.md section 3), judged when the step's batch is
   formed, against the version the step will improve: a group from version
   ``v`` is used only if ``0 <= lag(v_learner, v) <= max_staleness`` and
   ``v`` was not retracted (``broker.admission.accept``); otherwise it is
   acknowledged as ``stale_dropped`` or ``retracted_dropped``.

Every acknowledgement writes the group's ledger entry (``broker.ledger``):
``dropped`` with its reason here, ``trained`` by the trainer.

Groups are held in an ordered buffer keyed by group id, so a redelivery of
a group already held is not trained twice; the broker itself skips group
ids already acknowledged. A trained group is *held* (:meth:`Feeder.hold`)
until a durable checkpoint contains its update, and only then acknowledged
(:meth:`Feeder.ack_trained`): if the learner dies first, the broker delivers
it again and the resumed learner trains it again. Holding frees the group's
admission ticket at once (rollout servers go on), and the feeder keeps the
entries it holds from timing out (``Stream.touch``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict

import redis.asyncio as aioredis

from broker import Delivery, Keys, Stream, accept
from broker.admission import lag
from broker.ledger import Ledger
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
        self.ledger = Ledger(redis, keys)
        self.buffer: OrderedDict[str, tuple[Delivery, TrajectoryGroup]] = OrderedDict()
        self.held: dict[str, Delivery] = {}
        """Trained groups waiting for a durable checkpoint before their acknowledgement."""
        self.retracted: set[int] = set()
        """Versions withdrawn at a resume (the trainer sets them)."""
        self.counts: Counter[str] = Counter()
        self.idle_s = 0.0
        self._touched = time.monotonic()

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
        handed: list[tuple[str, dict]] = []
        for d in deliveries:
            gid = d.envelope.group_id
            if gid in self.buffer or gid in self.held:
                continue  # a redelivery of a group this learner already holds
            group = await decode_delivery(self.stream, d, TrajectoryGroup)
            if group is None:  # dead-lettered with the validation error as its reason
                self.counts["dead_lettered"] += 1
                continue
            reason = check_group(group, self.vocab_size, self.max_len)
            if reason is None and group.run_id != self.keys.run_id:
                reason = f"group of run {group.run_id!r} on run {self.keys.run_id!r}'s stream"
            if reason is None:
                reason = self.cfg.sampling.logprobs_refusal(group.logprobs_mode)
            if reason is None and group.group_id != gid:
                reason = f"envelope group id {gid!r} differs from the payload's {group.group_id!r}"
            if reason is not None:
                await self.stream.dead_letter(d, reason)
                self.counts["dead_lettered"] += 1
                continue
            if self.cfg.loss.filter_zero_variance and not group_has_signal(group):
                await self.stream.ack([d], counter="zero_variance_dropped", event="dropped",
                                      details={"reason": "zero_variance", "version": group.policy_version})
                self.counts["zero_variance_dropped"] += 1
                continue
            self.buffer[gid] = (d, group)
            handed.append((gid, {"delivery": d.deliveries, "version": group.policy_version}))
        await self.ledger.append_many("handed", handed)

    async def drop_stale(self, v_learner: int) -> int:
        """Acknowledge and count every buffered group the acceptance rule refuses now."""
        eta, retracted = self.cfg.staleness.max_staleness, self.retracted
        refused = [gid for gid, (_d, g) in self.buffer.items() if not accept(v_learner, g.policy_version, eta, retracted)]
        by_reason: dict[str, list[str]] = {}
        for gid in refused:
            by_reason.setdefault("retracted" if self.buffer[gid][1].policy_version in retracted else "stale", []).append(gid)
        for reason, gids in by_reason.items():
            groups = [self.buffer.pop(gid) for gid in gids]
            await self.stream.ack(
                [d for d, _ in groups], counter=f"{reason}_dropped", event="dropped",
                details=[{"reason": reason, "version": g.policy_version, "basis": v_learner,
                          "lag": lag(v_learner, g.policy_version, retracted)} for _, g in groups],
            )
            self.counts[f"{reason}_dropped"] += len(gids)
        return len(refused)

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
            await self._touch_held()
            t0 = time.monotonic()
            got = await self.stream.read(self.consumer, count=want - len(self.buffer), block_ms=int(min(1.0, left) * 1000))
            self.idle_s += time.monotonic() - t0
            await self._admit(got)

    async def hold(self, deliveries: list[Delivery]) -> None:
        """These groups were trained: keep them until a checkpoint holds their update; free their tickets."""
        self.held.update((d.envelope.group_id, d) for d in deliveries)
        await self.stream.release_tickets(d.envelope.group_id for d in deliveries)

    async def ack_trained(self, deliveries: list[Delivery], details: list[dict] | None = None) -> None:
        """A durable checkpoint holds their update: their groups are done (never trained again), each
        with its ledger ``trained`` entry (``details``: step, basis, version)."""
        await self.stream.ack(deliveries, counter="accepted", event="trained", details=details)
        for d in deliveries:
            self.held.pop(d.envelope.group_id, None)

    async def _touch_held(self) -> None:
        """Keep what this learner holds on purpose from reaching the visibility timeout."""
        if time.monotonic() - self._touched < self.cfg.staleness.visibility_timeout_s / 3:
            return
        await self.stream.touch(self.consumer, [*self.held.values(), *(d for d, _ in self.buffer.values())])
        self._touched = time.monotonic()
