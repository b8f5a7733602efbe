"""A version broadcast in memory into the session's real vLLM engine (publish.transport = "broadcast").

The learner's side is ``services.weightgroup`` at rank 0 in a thread of this process, sending the
tensors of a version written in the learner's layout; the engine joins as rank 1 through its worker
extension, over real gloo.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from safetensors.torch import load_file

from host.processes import free_port
from services.weightgroup import Invitation, WeightGroup
from services.wire import LoadWeights

pytestmark = pytest.mark.usefixtures("engine_left_serving")

PROMPT = "The answer is"
ATOL = 2e-3  # the project's tolerance between two computations of the same weights (tests/integration/rollout_server/test_http.py)


def _learner(engine, tensors: dict, version: int, timeout_s: float = 60.0,
             cls=WeightGroup) -> tuple[Invitation, threading.Thread, list]:
    """Rank 0 of a 2-rank group sending ``tensors`` to ``engine`` in a thread, signed with the engine's key;
    (the engine's seat, the thread, [digest or error])."""
    port, out = free_port(), []
    group = cls("127.0.0.1", port, 0, 2, key=engine.broadcast_key, timeout_s=timeout_s, name=f"v{version}")

    def send() -> None:
        try:
            out.append(group.send(tensors, bucket_bytes=1 << 16))  # several buckets even for the tiny model
        except BaseException as e:  # noqa: BLE001  asserted by the test
            out.append(e)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    return Invitation("127.0.0.1", port, f"v{version}", 1, 2, timeout_s), t, out


async def _greedy(engine, ids):
    from rollout_server.engine import Sampling

    out = await asyncio.wait_for(engine.generate(ids, Sampling(n=1, max_tokens=12, temperature=0.0)), 120)
    return out.samples[0]


async def test_logprobs_after_a_broadcast_equal_those_after_a_file_reload(rollout_engine, weight_versions,
                                                                          hf_logprobs):
    engine = rollout_engine
    ids = engine.tokenize(PROMPT)
    await engine.load_weights(weight_versions.make(seed=120))
    before = await _greedy(engine, ids)

    d = weight_versions.weights_of_seed(121)
    v = weight_versions.next_version()
    weight_versions.dirs[v] = d
    seat, sender, sent = _learner(engine, load_file(d / "model.safetensors"), v)
    status = await engine.load_weights(LoadWeights(version=v, uri=seat.uri))
    sender.join(30)
    assert isinstance(sent[0], str), sent
    assert status.version == engine.version == v
    broadcast = await _greedy(engine, ids)
    assert broadcast.policy_version == v

    await engine.load_weights(weight_versions.make(seed=121))  # the same weights, as a file
    by_file = await _greedy(engine, ids)

    assert broadcast.token_ids == by_file.token_ids
    worst = max(abs(a - b) for a, b in zip(broadcast.logprobs, by_file.logprobs, strict=True))
    assert worst < ATOL, f"broadcast and file reload of the same weights differ by {worst}"
    ref = hf_logprobs(d, ids, broadcast.token_ids)
    assert max(abs(a - b) for a, b in zip(broadcast.logprobs, ref, strict=True)) < ATOL
    # and the broadcast did change the weights (seed 120 -> 121)
    changed = before.token_ids != broadcast.token_ids or max(
        abs(a - b) for a, b in zip(before.logprobs, broadcast.logprobs, strict=False)) > 1e-2
    assert changed, "the broadcast left the previous weights serving"


async def test_a_broadcast_whose_digest_differs_is_refused_and_the_old_version_keeps_serving(rollout_engine,
                                                                                             weight_versions):
    from rollout_server.transports import WeightLoadError
    from tests.integration.services.test_weightgroup import LyingLearner

    engine = rollout_engine
    ids = engine.tokenize(PROMPT)
    await engine.load_weights(weight_versions.make(seed=122))
    kept, before = engine.version, await _greedy(engine, ids)
    v = weight_versions.next_version()
    seat, sender, _ = _learner(engine, load_file(weight_versions.weights_of_seed(123) / "model.safetensors"), v,
                               cls=LyingLearner)
    with pytest.raises(WeightLoadError, match="digest"):
        await engine.load_weights(LoadWeights(version=v, uri=seat.uri))
    sender.join(30)
    assert engine.version == kept
    after = await _greedy(engine, ids)
    assert after.token_ids == before.token_ids and after.policy_version == kept


async def test_a_broadcast_of_another_model_is_refused_before_the_engine_is_touched(rollout_engine, weight_versions):
    import torch

    from rollout_server.transports import WeightLoadError

    engine = rollout_engine
    kept = engine.version
    v = weight_versions.next_version()
    seat, sender, _ = _learner(engine, {"model.embed_tokens.weight": torch.zeros(3, 2)}, v, timeout_s=3.0)
    with pytest.raises(WeightLoadError, match="does not fit the served model") as e:
        await engine.load_weights(LoadWeights(version=v, uri=seat.uri))
    assert e.value.status == 422 and engine.version == kept
    assert not await engine.llm.is_paused()
    sender.join(30)  # the learner gives up after its timeout: nobody joined


LEARNER = """
import sys, time
from safetensors.torch import load_file
from services.weightgroup import WeightGroup, encode, manifest
g = WeightGroup("127.0.0.1", 0, 0, 2, key=bytes.fromhex(sys.argv[3]), timeout_s=60.0, name=sys.argv[2])
g.store.set("bucket_bytes", str(1 << 16))
g.store.set("manifest", encode(manifest(load_file(sys.argv[1]))))  # what send() does first
print(g.port, flush=True)
g._group()  # the engine joined
print("formed", flush=True)
time.sleep(600)  # a learner that dies before the first bucket
"""


async def test_a_learner_killed_mid_broadcast_leaves_the_engine_serving_the_old_version(rollout_engine,
                                                                                       weight_versions):
    import subprocess
    import sys

    from rollout_server.transports import WeightLoadError

    engine = rollout_engine
    ids = engine.tokenize(PROMPT)
    await engine.load_weights(weight_versions.make(seed=124))
    kept, before = engine.version, await _greedy(engine, ids)
    v = weight_versions.next_version()
    learner = subprocess.Popen([sys.executable, "-c", LEARNER, str(weight_versions.weights_of_seed(125) /
                                                                    "model.safetensors"), f"v{v}", engine.broadcast_key.hex()],
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        port = int(await asyncio.to_thread(learner.stdout.readline))
        seat = Invitation("127.0.0.1", port, f"v{v}", 1, 2, 10.0)
        load = asyncio.create_task(engine.load_weights(LoadWeights(version=v, uri=seat.uri)))
        assert (await asyncio.to_thread(learner.stdout.readline)).strip() == "formed"
        learner.kill()
        with pytest.raises(WeightLoadError, match="not received"):
            await asyncio.wait_for(load, 60)
    finally:
        learner.kill()
        learner.wait()
    assert engine.alive and engine.version == kept and not await engine.llm.is_paused()
    after = await _greedy(engine, ids)
    assert after.token_ids == before.token_ids and after.policy_version == kept
