"""The learner service with publish.transport = "broadcast": real process, real DeepSpeed (CPU), real Redis,
real gloo. The test is the rollout side: a member of the run's board that receives every version in memory
(``services.weightgroup``) while it feeds groups of the latest version. Each version the learner then
writes in the background holds exactly the weights it broadcast, and registers in order."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch

from tests.fixtures.learner import read_jsonl, write_run_config
from tests.integration.learner.test_service import _produce, _wait

pytestmark = pytest.mark.slow


def _fingerprint(tensors: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


async def _member(redis, keys, received: dict[int, str], stop: asyncio.Event) -> None:
    """A rollout server's broadcast watcher, without vLLM: join, wait for a seat, receive."""
    from broker.broadcast import BroadcastBoard
    from services.weightgroup import WeightGroup, broadcast_key

    board, after = BroadcastBoard(redis, keys), 0
    while not stop.is_set():
        await board.join("member", 1)
        a = await board.wait_seat("member", after, timeout_s=1.0)
        if a is None:
            continue
        group = WeightGroup(a.host, a.port, a.seats["member"], a.world, key=broadcast_key(None),  # the learner has no token
                            timeout_s=a.timeout_s, name=a.group)
        tensors, _digest = await asyncio.to_thread(group.receive)
        received[a.version] = _fingerprint(tensors)
        after = a.version


async def test_every_version_is_broadcast_then_written_with_the_same_weights(redis, keys, tiny_model, tmp_path,
                                                                             learner_proc):
    from safetensors.torch import load_file

    from broker import WeightRegistry
    from broker.ledger import Ledger
    from deploy.audit import audit
    from services import weightstore as store

    cfg_path = write_run_config(tmp_path / "run.toml", tiny_model, {
        "learner": {"steps": 3, "checkpoint_every": 2}, "publish": {"transport": "broadcast"}})
    received: dict[int, str] = {}
    stop = asyncio.Event()
    member = asyncio.create_task(_member(redis, keys, received, stop))
    proc = learner_proc(cfg_path, keys.run_id)
    producer = asyncio.create_task(_produce(redis, keys, stop))
    try:
        st = await _wait(proc, lambda s: s["state"] == "done", 300, "3 steps")
    finally:
        stop.set()
        await producer
        await asyncio.wait_for(member, 30)

    assert st["step"] == 3 and st["version"] == 3
    published = read_jsonl(tmp_path / "runs" / keys.run_id / "learner" / "published.jsonl")
    assert [p["version"] for p in published] == [1, 2, 3]
    assert [p["broadcast_to"] for p in published] == [1, 1, 1]
    for p in published:  # the write is not what the learner waited for
        assert p["blocked_s"] < p["gather_s"] + p["broadcast_s"] + 0.5 and p["write_s"] > 0, p
    history = await WeightRegistry(redis, keys).history()
    assert [w.version for w in history] == [1, 2, 3]
    for w in history:
        assert store.digest(w.uri) == w.sha256
        files = {}
        for f in store.weight_files(w.uri):
            files |= load_file(f)
        assert _fingerprint(files) == received[w.version], f"v{w.version}: the files differ from the broadcast"
    entries = await Ledger(redis, keys).read()
    assert [e["d"]["version"] for e in entries if e["e"] == "broadcast_sent" and e["d"]["digest"]] == [1, 2, 3]
    # the versions' rules (the test's producer queues groups until it is stopped, after the run closed: those
    # end in no ledger entry, which the audit reports too)
    report = audit(entries)
    assert report.published == [1, 2, 3] and not [v for v in report.violations if "version" in v], report.violations
