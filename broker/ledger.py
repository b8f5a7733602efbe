"""The trajectory ledger: an append-only record of every prompt group's life in a run.

One Redis stream per run (``Keys.ledger``). Each entry has ``e`` (the
event), ``g`` (the group id; empty for version events) and ``d`` (a JSON
object of details); its stream id gives the time. The events:

- ``queued`` (control plane, in the enqueue transaction): epoch, index.
- ``admitted`` (rollout server, on taking a prompt under an admission
  ticket; again after a redelivery): server, loaded_version.
- ``generated`` (rollout server, in the hand-off script, after scoring):
  server, version, statuses (samples per reward status), reward_mean.
- ``handed`` (learner, when the group enters its batch buffer): delivery.
- ``trained`` (learner, in the ack script, once the checkpoint holding the
  step is durable): step, basis (``v_learner`` when the batch was formed),
  version (the group's).
- ``dropped`` (whoever drops it, in the ack, dead-letter or close script):
  reason (``stale``, ``zero_variance``, ``empty``, ``retracted``,
  ``dead_lettered``, ``run_finished``, ``run_stopped``, ``run_failed``) and
  what else explains it.
- ``published`` (learner, in the registry's publish script): version,
  sha256, step.
- ``retracted`` (learner, at a resume): versions, checkpoint_step,
  lost_steps.
- ``loaded`` (rollout server, after the version's checksum matched):
  server, version, sha256; ``received`` for a version that came by
  broadcast: server, version. Both are written by the swap's own task
  (``RolloutEngine.load_weights``' ``record``), so a server never serves a
  version without its record, even when its actor is cancelled at the swap.
- ``broadcast`` (learner, before announcing a version in memory): version,
  members; ``broadcast_sent`` (after the send): digest or error, seconds.
- ``started`` (learner, at each start): pid, step, version, max_staleness.

Exactly once: ``generated`` and the terminal events (``trained``,
``dropped``) are written only by the Lua script that adds the group id to
the stream's ``done`` set, and only when the id was not in it yet. So a
group gets at most one of each per stream, whatever is retried or
redelivered, and a state change and its ledger entry are one atomic step:
they survive, or are lost, together. The stream persists with Redis (its
AOF); the learner exports it to ``ledger.jsonl`` in the run directory when
the run ends, and :mod:`deploy.audit` checks either.
"""

from __future__ import annotations

import json
from pathlib import Path

import redis.asyncio as aioredis

from broker.keys import Keys
from host.files import write_atomic

LEDGER_FILE = "ledger.jsonl"

LUA = """
local function ledger(key, event, gid, detail)
  redis.call('XADD', key, '*', 'e', event, 'g', gid, 'd', detail)
end
"""
"""Prepended to the broker's scripts that write ledger entries."""


def detail(**fields) -> str:
    """The ``d`` field of an entry."""
    return json.dumps(fields, separators=(",", ":"))


class Ledger:
    """One run's ledger: append events, read them back, export them to a file."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def append(self, event: str, group_id: str = "", **fields) -> None:
        await self.redis.xadd(self.keys.ledger, {"e": event, "g": group_id, "d": detail(**fields)})

    async def append_many(self, event: str, entries: list[tuple[str, dict]]) -> None:
        """One ``event`` entry per (group id, details), in one round trip."""
        if entries:
            pipe = self.redis.pipeline(transaction=False)
            for gid, fields in entries:
                pipe.xadd(self.keys.ledger, {"e": event, "g": gid, "d": detail(**fields)})
            await pipe.execute()

    async def read(self, page: int = 10_000) -> list[dict]:
        """Every entry, oldest first, as ``{"t": unix ms, "e": event, "g": group id, "d": {...}}``."""
        out: list[dict] = []
        start = "-"
        while True:
            rows = await self.redis.xrange(self.keys.ledger, min=start, count=page)
            out += [_record(entry_id, fields) for entry_id, fields in rows]
            if len(rows) < page:
                return out
            start = "(" + rows[-1][0].decode()

    async def export(self, path: Path) -> int:
        """Write every entry to ``path`` (JSON lines), atomically; returns how many."""
        records = await self.read()
        write_atomic(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
        return len(records)


def read_file(path: Path) -> list[dict]:
    """The entries :meth:`Ledger.export` wrote."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _record(entry_id: bytes, fields: dict[bytes, bytes]) -> dict:
    return {"t": int(entry_id.split(b"-")[0]), "e": fields[b"e"].decode(), "g": fields[b"g"].decode(),
            "d": json.loads(fields.get(b"d", b"{}"))}
