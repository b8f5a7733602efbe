"""The ledger's record that a server holds a version (``loaded`` from files, ``received`` by broadcast) and the
swap itself are one unit: an actor cancelled right after its engine swapped a version in (the run ended at that
moment, as CI saw at the last version of a broadcast run) still leaves the record. Real Redis, the session's real
vLLM engine, a real Broadcaster over gloo; the cancellation is injected at the end of the engine's swap."""

from __future__ import annotations

import asyncio

import pytest
from safetensors.torch import load_file

from broker import WeightRegistry
from broker.broadcast import BroadcastBoard
from broker.ledger import Ledger
from learner.publisher import Broadcaster
from tests.integration.rollout_server.test_actor import _config, _publish, actor_factory  # noqa: F401  (the fixture)
from tests.integration.rollout_server.test_actor_broadcast import _until

pytestmark = pytest.mark.usefixtures("engine_left_serving")


@pytest.mark.parametrize("transport", ["files", "broadcast"])
async def test_an_actor_cancelled_at_the_swap_still_records_the_version_it_serves(
    transport, actor_factory, redis, keys, tiny_model, tmp_path, weight_versions, rollout_engine, monkeypatch  # noqa: F811
):
    base = _config(tiny_model, tmp_path, eta=1, groups_per_step=1)
    config = base.model_copy(update={"publish": base.publish.model_copy(update={"transport": transport})})
    engine, v = rollout_engine, weight_versions.next_version()
    actor, task = actor_factory(config)

    load, swap, callers = engine.load_weights, engine._apply, {}

    async def load_weights(request, **kw):  # note which of the actor's tasks asked for v
        callers.setdefault(request.version, asyncio.current_task())
        return await load(request, **kw)

    async def swap_then_cancel(transport_, prepared, *mode) -> None:  # the run ends the moment v is in
        await swap(transport_, prepared, *mode)
        if prepared.request.version == v:
            callers[v].cancel()  # the task waiting on the swap (a TaskGroup's abort reaches it a few turns later)
            task.cancel()

    monkeypatch.setattr(engine, "load_weights", load_weights)
    monkeypatch.setattr(engine, "_apply", swap_then_cancel)
    if transport == "files":
        await _publish(WeightRegistry(redis, keys), weight_versions, 140, v)
        event, fields = "loaded", {"sha256": (await WeightRegistry(redis, keys).get(v)).sha256}
    else:
        board = BroadcastBoard(redis, keys)

        async def joined() -> bool:
            return actor.server_id in await board.members()

        await _until(joined, "the actor joining the board")
        weight_versions.dirs[v] = d = weight_versions.weights_of_seed(141)
        sent = await Broadcaster(redis, keys, config.publish, "127.0.0.1", engine.broadcast_key).send(v, load_file(d / "model.safetensors"))
        assert sent.error is None and sent.members == [actor.server_id], sent
        event, fields = "received", {}

    await asyncio.wait_for(asyncio.wait([task]), 60)
    assert task.cancelled()
    async with engine._reload_lock:  # the swap's task has ended (it holds the lock until then)
        assert engine.version == v
    records = [e["d"] for e in await Ledger(redis, keys).read() if e["e"] == event]
    assert {"server": actor.server_id, "version": v, **fields} in records, records
