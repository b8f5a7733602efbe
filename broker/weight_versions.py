"""The weight-version registry of a run.

The learner publishes versions ``1, 2, 3, ...`` (version 0 is the initial
policy, implicit until published); each is a directory or file of weights
at ``uri`` with a ``sha256`` over its content. Publishing is one
transaction: the ``latest`` hash, the history entry, and a pub/sub
notification on ``weights_channel``. Rollout servers subscribe to the
channel and also poll ``latest`` (pub/sub is fire-and-forget: a subscriber
that was disconnected would miss a message), so a notification can be late
but never lost.

A resumed learner *retracts* the versions published after the checkpoint it
restored (:meth:`WeightRegistry.retract`): their weights left the lineage.

Rollout servers report the version they serve (``report_in_use``) so the
learner deletes old versions only when no live server still uses them.
"""

from __future__ import annotations

import json
import time

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field

from broker.keys import Keys
from broker.ledger import LUA as LEDGER_LUA
from broker.ledger import detail as ledger_detail
from broker.streams import wait_notified


class WeightVersion(BaseModel):
    """A published policy version. ``version`` increases by one per publish."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(ge=0, description="Consecutive version number; 0 = the initial policy.")
    uri: str = Field(min_length=1, description="Where the weights are: a path or file:// URI.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Checksum of the weights at uri.")
    created_at: float = Field(description="Unix time of publication.")
    bytes: int = Field(default=0, ge=0, description="Size of the weights in bytes.")


class VersionConflict(Exception):
    """A publish that would skip or repeat a version."""


# KEYS: latest, history, channel, ledger, retracted. ARGV: version, record json, ledger detail
_PUBLISH = LEDGER_LUA + """
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '-1')
local v = tonumber(ARGV[1])
if cur ~= -1 and v <= cur then
  return {0, cur}
end
if cur ~= -1 then
  for skipped = cur + 1, v - 1 do
    if redis.call('SISMEMBER', KEYS[5], skipped) == 0 then
      return {0, cur}
    end
  end
end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'record', ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('PUBLISH', KEYS[3], ARGV[1])
ledger(KEYS[4], 'published', '', ARGV[3])
return {1, v}
"""


class WeightRegistry:
    """Published weight versions of one run."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._publish = redis.register_script(_PUBLISH)

    async def publish(self, wv: WeightVersion, step: int | None = None) -> None:
        """Register ``wv`` as the newest version and notify subscribers (and the ledger: the
        version, its sha256 and the learner ``step`` it holds).

        Raises :class:`VersionConflict` unless ``wv.version`` is exactly one
        above the current latest (the first publish may start anywhere, so
        a run resumed from a checkpoint continues its numbering), or above
        it by retracted versions only: numbers a learner broadcast in memory
        and died before registering (``learner.trainer``'s resume retracts
        them and never reuses their numbers).
        """
        ok, cur = await self._publish(
            keys=[self.keys.weights_latest, self.keys.weights_history, self.keys.weights_channel, self.keys.ledger,
                  self.keys.weights_retracted],
            args=[wv.version, wv.model_dump_json(), ledger_detail(version=wv.version, sha256=wv.sha256, step=step)],
        )
        if not ok:
            raise VersionConflict(f"cannot publish version {wv.version}: latest is {cur}")

    async def latest(self) -> WeightVersion | None:
        raw = await self.redis.hget(self.keys.weights_latest, "record")
        return None if raw is None else WeightVersion.model_validate_json(raw)

    async def latest_version(self) -> int:
        """The newest published version number, 0 when nothing was published."""
        raw = await self.redis.hget(self.keys.weights_latest, "version")
        return 0 if raw is None else int(raw)

    async def get(self, version: int) -> WeightVersion | None:
        raw = await self.redis.hget(self.keys.weights_history, str(version))
        return None if raw is None else WeightVersion.model_validate_json(raw)

    async def history(self) -> list[WeightVersion]:
        """Every version still registered, oldest first."""
        rows = await self.redis.hvals(self.keys.weights_history)
        return sorted((WeightVersion.model_validate_json(r) for r in rows), key=lambda w: w.version)

    async def retract(self, versions: list[int], **why) -> None:
        """Withdraw ``versions`` (their weights are no longer the learner's lineage): rollout servers
        refuse to load or generate with them, and the learner drops their groups as ``retracted``.
        One transaction with the ledger's ``retracted`` entry (details: ``why``)."""
        if not versions:
            return
        pipe = self.redis.pipeline(transaction=True)
        pipe.sadd(self.keys.weights_retracted, *versions)
        pipe.xadd(self.keys.ledger, {"e": "retracted", "g": "", "d": ledger_detail(versions=versions, **why)})
        await pipe.execute()

    async def retracted(self) -> set[int]:
        return {int(v) for v in await self.redis.smembers(self.keys.weights_retracted)}

    async def forget(self, versions: list[int]) -> None:
        """Remove ``versions`` from the history (after their files were deleted)."""
        if versions:
            await self.redis.hdel(self.keys.weights_history, *[str(v) for v in versions])

    async def wait_newer(self, version: int, timeout_s: float) -> WeightVersion | None:
        """The latest version if it is newer than ``version``, waiting up to ``timeout_s``
        (:func:`~broker.streams.wait_notified`: a publish between the check and the wait is not missed,
        a lost notification costs at most a second)."""

        async def newer() -> WeightVersion | None:
            latest = await self.latest()
            return latest if latest is not None and latest.version > version else None

        return await wait_notified(self.redis, self.keys.weights_channel, newer, timeout_s)

    async def report_in_use(self, server_id: str, version: int) -> None:
        """A rollout server says it serves ``version`` (call it as a heartbeat)."""
        await self.redis.hset(self.keys.weights_in_use, server_id, json.dumps([version, time.time()]))

    async def in_use(self, max_age_s: float = 120.0) -> dict[str, int]:
        """Versions served by rollout servers that reported within ``max_age_s``."""
        rows = await self.redis.hgetall(self.keys.weights_in_use)
        now = time.time()
        out = {}
        for server, raw in rows.items():
            version, at = json.loads(raw)
            if now - at <= max_age_s:
                out[server.decode()] = int(version)
        return out

