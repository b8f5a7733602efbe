"""The actor of a broadcast run (publish.transport = "broadcast") on the session's real vLLM engine: it joins
the run's board, receives the version the learner's Broadcaster streams, and still catches up from the
registry's files for a version it was not part of."""

from __future__ import annotations

import asyncio
import time

import pytest
from safetensors.torch import load_file

from broker import WeightRegistry, WeightVersion
from broker.broadcast import BroadcastBoard
from broker.ledger import Ledger
from learner.publisher import Broadcaster
from tests.integration.rollout_server.test_actor import _config, actor_factory  # noqa: F401  (the fixture)

pytestmark = pytest.mark.usefixtures("engine_left_serving")


async def _until(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        await asyncio.sleep(0.1)


async def test_an_actor_receives_a_broadcast_then_catches_up_from_files(actor_factory, redis, keys, tiny_model,  # noqa: F811
                                                                        tmp_path, weight_versions, rollout_engine):
    base = _config(tiny_model, tmp_path, eta=1, groups_per_step=1)
    config = base.model_copy(update={"publish": base.publish.model_copy(update={"transport": "broadcast"})})
    board, registry, engine = BroadcastBoard(redis, keys), WeightRegistry(redis, keys), rollout_engine
    actor, task = actor_factory(config)

    async def joined() -> bool:
        return actor.server_id in await board.members()

    await _until(joined, "the actor joining the board")

    v = weight_versions.next_version()
    d = weight_versions.weights_of_seed(130)
    weight_versions.dirs[v] = d
    sent = await Broadcaster(redis, keys, config.publish, "127.0.0.1", engine.broadcast_key).send(v, load_file(d / "model.safetensors"))
    assert sent.error is None and sent.members == [actor.server_id], sent

    async def serving_v() -> bool:
        return engine.version == v

    await _until(serving_v, f"the engine serving the broadcast v{v}")
    events = [(e["e"], e["d"]) for e in await Ledger(redis, keys).read()]
    assert ("received", {"server": actor.server_id, "version": v}) in events
    assert not any(kind == "loaded" for kind, _ in events)  # nothing came from a file

    # a version with no broadcast (the server was left out): the registry's files bring it
    req = weight_versions.make(seed=131)
    await registry.publish(WeightVersion(version=req.version, uri=req.uri, sha256=req.sha256, created_at=time.time()))

    async def serving_next() -> bool:
        return engine.version == req.version

    await _until(serving_next, f"the engine catching up to v{req.version} from its files")
    loaded = [d for kind, d in [(e["e"], e["d"]) for e in await Ledger(redis, keys).read()] if kind == "loaded"]
    assert [x["version"] for x in loaded] == [req.version]
    assert not task.done()
