"""Broadcast -> the real rollout engine (vLLM) receives the learner's version in memory -> its log-probs
equal the learner's (publish.transport = "broadcast").

The learner side is what rank 0 runs in ``learner.publisher.Publisher.publish``: weights gathered from two real ZeRO-3
DeepSpeed steps (``one_rank_runs``, as in ``test_publish_to_vllm``), handed to
``learner.publisher.Broadcaster``, which seats the members of the Redis board and streams the tensors
over gloo. The server side is what the actor's broadcast watcher runs: join the board, wait for a seat,
load the seat's ``broadcast://`` URI into the session's engine.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import uuid

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.usefixtures("engine_left_serving"),
]


async def test_a_broadcast_version_serves_the_learners_log_probs(one_rank_runs, rollout_engine, weight_versions,
                                                                 hf_logprobs, redis):
    from safetensors.torch import load_file

    from broker import Keys
    from broker.broadcast import BroadcastBoard
    from broker.ledger import Ledger
    from learner.publisher import Broadcaster
    from rollout_server.engine import Sampling
    from services import weightstore as store
    from services.config import PublishConfig
    from services.weightgroup import Invitation
    from services.wire import LoadWeights

    run = one_rank_runs["zero3"]
    report = json.loads(run.with_name(run.name + ".json").read_text())
    tensors = load_file(run)
    keys = Keys(f"broadcast-{uuid.uuid4().hex[:8]}")
    board = BroadcastBoard(redis, keys)
    engine = rollout_engine
    version = weight_versions.next_version()

    await board.join("rollout-a", engine.workers)
    learner = Broadcaster(redis, keys, PublishConfig(transport="broadcast", broadcast_timeout_s=60), "127.0.0.1",
                          engine.broadcast_key)
    sending = asyncio.create_task(learner.send(version, tensors))
    a = await board.wait_seat("rollout-a", engine.version, timeout_s=60)
    assert a is not None and a.version == version and a.world == 1 + engine.workers
    seat = Invitation(a.host, a.port, a.group, a.seats["rollout-a"], a.world, a.timeout_s)
    await engine.load_weights(LoadWeights(version=version, uri=seat.uri))
    sent = await asyncio.wait_for(sending, 60)
    assert sent.digest is not None and sent.error is None and sent.members == ["rollout-a"]
    events = [(e["e"], e["d"]) for e in await Ledger(redis, keys).read()]
    assert events[0] == ("broadcast", {"version": version, "members": ["rollout-a"]})
    assert events[1][0] == "broadcast_sent" and events[1][1]["digest"] == sent.digest

    # the files the learner then writes hold the same weights; the learner's own log-probs are what they give
    written = store.write_version(weight_versions.root / f"broadcast-{keys.run_id}", version, tensors, step=2)
    weight_versions.dirs[version] = written.path
    probe = report["probe"]
    assert hf_logprobs(written.path, probe[:1], probe[1:]) == pytest.approx(report["probe_logprobs"], abs=2e-4)
    prompt = probe[:4]
    out = await asyncio.wait_for(engine.generate(prompt, Sampling(n=2, max_tokens=8, temperature=1.0, seed=0)), 120)
    for s in out.samples:
        assert s.policy_version == version
        assert s.logprobs == pytest.approx(hf_logprobs(written.path, prompt, s.token_ids), abs=2e-4)
