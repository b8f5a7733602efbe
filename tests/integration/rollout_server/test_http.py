"""The rollout server over real HTTP around the session's real vLLM engine (CPU)."""

from __future__ import annotations

import asyncio
import math
import shutil
import time

import httpx
import pytest

from services.wire import GenerateResponse
from tests.fixtures.rollout import MAX_MODEL_LEN

pytestmark = pytest.mark.usefixtures("engine_left_serving")

PROMPT = "The answer is"


async def _client(server) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120)


async def _generate(client, **body) -> GenerateResponse:
    r = await client.post("/v1/generate", json=body)
    assert r.status_code == 200, r.text
    return GenerateResponse.model_validate(r.json())


async def _version(client) -> int:
    r = await client.get("/v1/weights")
    assert r.status_code == 200, r.text
    return r.json()["version"]


def _assert_matches_hf(hf_logprobs, weight_versions, prompt_ids, sample, atol=2e-3):
    ref = hf_logprobs(weight_versions.dir_of(sample.policy_version), prompt_ids, sample.token_ids)
    worst = max(abs(a - b) for a, b in zip(sample.logprobs, ref, strict=True))
    assert worst < atol, f"vLLM logprobs differ from HF on version {sample.policy_version} by {worst}"


# -- auth ----------------------------------------------------------------------


async def test_auth_required_except_healthz(rollout_server):
    async with httpx.AsyncClient(base_url=rollout_server.url, timeout=30) as c:
        assert (await c.get("/healthz")).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
            r = await c.post("/v1/generate", json={"prompt": PROMPT}, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            assert (await c.get("/v1/weights", headers=headers)).status_code == 401
            assert (await c.get("/metrics", headers=headers)).status_code == 401


# -- generation ------------------------------------------------------------------


async def test_generate_n8_shapes_and_logprobs_match_hf(rollout_server, hf_logprobs, weight_versions):
    async with await _client(rollout_server) as c:
        version = await _version(c)
        out = await _generate(c, prompt=PROMPT, n=8, max_tokens=24, temperature=1.0, seed=7)
    assert out.logprobs_mode == "processed_logprobs"
    assert out.prompt_token_ids == rollout_server.app.state.engine.tokenize(PROMPT)
    assert len(out.samples) == 8
    assert len({tuple(s.token_ids) for s in out.samples}) > 1, "8 samples at temperature 1 should differ"
    for s in out.samples:
        assert 1 <= len(s.token_ids) <= 24
        assert len(s.logprobs) == len(s.token_ids)
        assert all(math.isfinite(x) and x <= 0 for x in s.logprobs)
        assert s.policy_version == version
        assert s.finish_reason in ("stop", "length")
        assert s.finish_reason == "stop" or len(s.token_ids) == 24
        _assert_matches_hf(hf_logprobs, weight_versions, out.prompt_token_ids, s)


async def test_logprobs_are_of_the_tempered_distribution_sampled_from(rollout_server, hf_logprobs, weight_versions):
    """processed_logprobs (the default) = log_softmax(logits / T): what the learner recomputes at T."""
    async with await _client(rollout_server) as c:
        out = await _generate(c, prompt_token_ids=[10, 11, 12], n=4, max_tokens=16, temperature=0.6, seed=3)
    for s in out.samples:
        ref = hf_logprobs(weight_versions.dir_of(s.policy_version), [10, 11, 12], s.token_ids, temperature=0.6)
        t1 = hf_logprobs(weight_versions.dir_of(s.policy_version), [10, 11, 12], s.token_ids)
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref, strict=True)) < 2e-3
        assert max(abs(a - b) for a, b in zip(s.logprobs, t1, strict=True)) > 1e-2  # not the temperature-1 policy


async def test_seed_makes_sampling_repeatable(rollout_server):
    async with await _client(rollout_server) as c:
        body = dict(prompt=PROMPT, n=3, max_tokens=12, seed=1234)
        a, b = await asyncio.gather(_generate(c, **body), _generate(c, **body))
    assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]


async def test_stop_string_ends_completion(rollout_server):
    async with await _client(rollout_server) as c:
        base = await _generate(c, prompt=PROMPT, n=1, max_tokens=40, temperature=0)
        text = base.samples[0].text
        assert len(text) >= 6
        stop = text[3:5]
        out = await _generate(c, prompt=PROMPT, n=1, max_tokens=40, temperature=0, stop=[stop])
    s = out.samples[0]
    assert s.finish_reason == "stop"
    assert stop not in s.text and text.startswith(s.text)
    assert len(s.token_ids) == len(s.logprobs)


async def test_concurrent_requests_are_batched(rollout_server):
    """16 concurrent requests take far less than 16 sequential ones (continuous batching)."""
    async with await _client(rollout_server) as c:
        body = dict(prompt=PROMPT, n=1, max_tokens=48, temperature=1.0, seed=3)
        await _generate(c, **body)
        loop = asyncio.get_running_loop()
        sequential, concurrent = [], []
        for _ in range(2):  # interleaved, best of each: a burst of load from elsewhere slows one run, not the best
            for _ in range(2):
                t0 = loop.time()
                await _generate(c, **body)
                sequential.append(loop.time() - t0)
            t0 = loop.time()
            outs = await asyncio.gather(*[_generate(c, **{**body, "seed": i}) for i in range(16)])
            concurrent.append(loop.time() - t0)
            assert all(len(o.samples) == 1 for o in outs)
    assert min(concurrent) < 16 * min(sequential) / 3, (concurrent, sequential)


# -- bad input -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt": PROMPT, "n": 0}, "n"),
        ({"prompt": PROMPT, "n": 17}, "n"),  # the server's max_n is 16
        ({"prompt": PROMPT, "max_tokens": 10_000}, "max_tokens"),
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "temprature": 0.5}, "temprature"),
        ({"prompt": "x" * 300}, "prompt"),  # 300 characters = 300 tokens > 256 context
        ({"prompt_token_ids": [1, 2, 10_000]}, "prompt_token_ids"),
        ({"prompt": PROMPT, "top_p": 0}, "top_p"),
        ({"prompt": PROMPT, "prompt_token_ids": [4]}, "body"),
    ],
)
async def test_bad_input_is_422_naming_the_field(rollout_server, body, field):
    async with await _client(rollout_server) as c:
        r = await c.post("/v1/generate", json=body)
    assert r.status_code == 422, r.text
    locs = [e["loc"] for e in r.json()["detail"]]
    if field == "body":
        assert any(loc == ["body"] for loc in locs), locs
    else:
        assert any(field in loc for loc in locs), locs


async def test_over_capacity_is_503_with_retry_after(rollout_engine, serve_app):
    from pydantic import SecretStr

    from rollout_server import build_app
    from rollout_server.settings import RolloutSettings

    token = "capacity-test-token"  # services.settings.MIN_TOKEN_CHARS
    settings = RolloutSettings(token=SecretStr(token), max_n=8, max_pending_seqs=8, redis_url=None)
    async with serve_app(build_app(settings, engine=rollout_engine), token=token) as server:
        async with await _client(server) as c:
            body = {"prompt": PROMPT, "n": 8, "max_tokens": 200, "temperature": 1.0}
            rs = await asyncio.gather(*[c.post("/v1/generate", json=body) for _ in range(3)])
            codes = sorted(r.status_code for r in rs)
            assert codes[0] == 200 and 503 in codes, codes
            busy = next(r for r in rs if r.status_code == 503)
            assert int(busy.headers["retry-after"]) >= 1
            # capacity frees once the admitted request is done
            assert (await c.post("/v1/generate", json=body)).status_code == 200


# -- weights -------------------------------------------------------------------


async def test_weight_reload_changes_outputs_and_tags(rollout_server, weight_versions, hf_logprobs):
    async with await _client(rollout_server) as c:
        before_v = await _version(c)
        # seeded sampling: same random draws, so different outputs mean different weights
        # (greedy decoding is a poor probe on random tied-embedding models: it repeats the last token)
        probe = dict(prompt=PROMPT, n=1, max_tokens=32, temperature=1.0, seed=11)
        before = await _generate(c, **probe)
        req = weight_versions.make(seed=101)
        r = await c.post("/v1/weights", json=req.model_dump())
        assert r.status_code == 200, r.text
        assert r.json()["version"] == req.version > before_v
        assert r.json()["reload_s"] > 0
        assert await _version(c) == req.version
        after = await _generate(c, **probe)
        assert after.samples[0].policy_version == req.version
        assert after.samples[0].token_ids != before.samples[0].token_ids
        assert after.samples[0].logprobs[0] != before.samples[0].logprobs[0]
        # the new weights are really in use: logprobs match HF on them (incl. the tied lm_head)
        _assert_matches_hf(hf_logprobs, weight_versions, after.prompt_token_ids, after.samples[0])
        # an older or equal version is a no-op, even with different weights
        for v in (req.version, req.version - 1):
            stale = weight_versions.make(seed=102, version=v)
            r = await c.post("/v1/weights", json=stale.model_dump())
            assert r.status_code == 200 and r.json()["version"] == req.version
        again = await _generate(c, **probe)
        assert again.samples[0].token_ids == after.samples[0].token_ids
        metrics = (await c.get("/metrics")).text
        assert f"tandem_rollout_policy_version {float(req.version)}" in metrics
        assert "tandem_rollout_reload_seconds_count" in metrics
        assert "tandem_rollout_generated_tokens_total" in metrics


def _published(weight_versions, version: int, path, sha256: str | None = None) -> dict:
    """Register ``path`` as ``version`` (its own digest unless ``sha256``); the matching request body."""
    from services.weightstore import digest

    sha256 = sha256 or digest(path)
    weight_versions.register(version, path, sha256)
    return {"version": version, "uri": str(path), "sha256": sha256}


async def test_bad_checkpoints_are_refused_and_old_weights_keep_serving(rollout_server, weight_versions, tmp_path):
    """Versions the registry holds (the learner published them) but whose files are wrong."""
    from examples.tiny import tiny_qwen3

    store = weight_versions.root / f"bad-{tmp_path.name}"  # inside the server's weight store
    store.mkdir()
    async with await _client(rollout_server) as c:
        v = await _version(c)
        probe = dict(prompt=PROMPT, n=1, max_tokens=24, temperature=1.0, seed=12)
        before = await _generate(c, **probe)
        good = weight_versions.make(seed=103)

        # missing directory (published, then deleted)
        r = await c.post("/v1/weights", json=_published(weight_versions, good.version, store / "nope", good.sha256))
        assert r.status_code == 404, r.text
        # checksum mismatch (the files changed after the publish)
        r = await c.post("/v1/weights", json=_published(weight_versions, good.version,
                                                        weight_versions.dir_of(good.version), "0" * 64))
        assert r.status_code == 422 and "checksum" in r.json()["detail"], r.text
        # truncated file (published with its own checksum: caught by the header check)
        broken = store / "truncated"
        broken.mkdir()
        src = weight_versions.weights_of_seed(103) / "model.safetensors"
        (broken / "model.safetensors").write_bytes(src.read_bytes()[: src.stat().st_size // 2])
        r = await c.post("/v1/weights", json=_published(weight_versions, good.version, broken))
        assert r.status_code == 422, r.text
        # a model of another shape
        other = tiny_qwen3(store / "other", hidden=96, seed=5)
        r = await c.post("/v1/weights", json=_published(weight_versions, good.version, other))
        assert r.status_code == 422 and "shape" in r.json()["detail"], r.text
        # unsupported scheme
        r = await c.post("/v1/weights", json={**good.model_dump(), "uri": "s3://bucket/v1"})
        assert r.status_code == 422 and r.json()["detail"].startswith("uri:"), r.text
        weight_versions.register(good.version, weight_versions.dir_of(good.version), good.sha256)

        assert await _version(c) == v
        after = await _generate(c, **probe)
        assert after.samples[0].token_ids == before.samples[0].token_ids
        assert after.samples[0].logprobs == pytest.approx(before.samples[0].logprobs, abs=1e-5)
        assert after.samples[0].policy_version == v
        # and the good one still loads
        r = await c.post("/v1/weights", json=good.model_dump())
        assert r.status_code == 200 and r.json()["version"] == good.version


async def test_version_tags_are_true_under_reloads_during_generation(rollout_server, weight_versions, hf_logprobs):
    """Requests in flight while weights change: each sample's tag names the weights that
    produced it (its logprobs match HF on that version's weights, not on the other)."""
    async with await _client(rollout_server) as c:
        first = await _version(c)
        body = dict(prompt=PROMPT, n=4, max_tokens=64, temperature=1.0)

        # build the weights up front: the reloads must land while requests are in flight. Numbered above
        # the version the server reports: in one CI run the fixture's count lagged it (first = 41 with
        # versions 40 and 41 issued, so both loads were no-ops; cause not found)
        v = max(weight_versions.next_version(), first + 1)
        req1, req2 = weight_versions.make(seed=104, version=v), weight_versions.make(seed=105, version=v + 1)

        # each reload waits for a batch to finish, then lands while the next batch is generating: timed
        # from the test's start, both reloads could land before a loaded machine had generated anything;
        # and batches go on until one has started after both reloads answered (CI saw a loaded machine
        # finish six batches before the first reload landed)
        done = [asyncio.Event() for _ in range(2)]
        landed = asyncio.Event()

        async def reload_during(req, batch):
            await done[batch].wait()
            await asyncio.sleep(0.3)
            r = await c.post("/v1/weights", json=req.model_dump())
            assert r.status_code == 200, r.text
            return r.json()["version"]

        async def reloads():
            versions = await asyncio.gather(reload_during(req1, 0), reload_during(req2, 1))
            landed.set()
            return versions

        async def stream_of_requests():
            outs = []
            for i in range(60):
                after_both = landed.is_set()
                batch = await asyncio.gather(*[_generate(c, **body) for _ in range(4)])
                outs += batch
                if i < len(done):
                    done[i].set()
                if after_both:
                    break
            return outs

        outs, (v1, v2) = await asyncio.gather(stream_of_requests(), reloads())
    assert first < v1 < v2
    seen = set()
    for out in outs:
        for s in out.samples:
            seen.add(s.policy_version)
            assert s.policy_version in (first, v1, v2)
            _assert_matches_hf(hf_logprobs, weight_versions, out.prompt_token_ids, s)
    assert len(seen) >= 2, f"reloads did not overlap generation (versions seen: {seen})"


async def test_missing_weight_copy_does_not_break_later_loads(rollout_server, weight_versions, tmp_path):
    """A version directory deleted after it was published is a 404, the next one loads."""
    store = weight_versions.root / f"copies-{tmp_path.name}"
    async with await _client(rollout_server) as c:
        gone = weight_versions.make(seed=106)
        moved = store / "moved"
        shutil.copytree(weight_versions.dir_of(gone.version), moved)
        r = await c.post("/v1/weights", json=_published(weight_versions, gone.version, store / "deleted", gone.sha256))
        assert r.status_code == 404
        body = _published(weight_versions, gone.version, moved, gone.sha256)
        r = await c.post("/v1/weights", json={**body, "uri": moved.as_uri()})
        assert r.status_code == 200 and r.json()["version"] == gone.version


async def test_reset_to_base_serves_the_model_directory_again(rollout_server, rollout_engine, weight_versions,
                                                              hf_logprobs):
    """A new run on a long-lived server starts from the base weights, not the previous run's last version."""
    async with await _client(rollout_server) as c:
        req = weight_versions.make(seed=108)
        assert (await c.post("/v1/weights", json=req.model_dump())).status_code == 200
        assert (await rollout_engine.reset_to_base()).version == 0
        assert await _version(c) == 0
        out = await _generate(c, prompt=PROMPT, n=2, max_tokens=16, temperature=1.0, seed=5)
        for s in out.samples:
            assert s.policy_version == 0
            ref = hf_logprobs(weight_versions.base_model, out.prompt_token_ids, s.token_ids)
            assert max(abs(a - b) for a, b in zip(s.logprobs, ref, strict=True)) < 2e-3
        # newer versions load again afterwards
        nxt = weight_versions.make(seed=109)
        r = await c.post("/v1/weights", json=nxt.model_dump())
        assert r.status_code == 200 and r.json()["version"] == nxt.version


async def test_a_reload_cancelled_half_way_still_finishes_and_generation_resumes(rollout_engine, weight_versions):
    """An actor stopped mid-reload (its run ended) cancels ``load_weights`` while vLLM's scheduler
    is paused, draining the requests in flight: the reload must still finish and generation
    resume (it once stayed paused until the next reload came along)."""
    from rollout_server.engine import Sampling

    engine = rollout_engine
    ids = engine.tokenize(PROMPT)
    req = weight_versions.make(seed=110)  # written before: the reload must start while in_flight runs
    long = Sampling(n=64, max_tokens=MAX_MODEL_LEN - len(ids), temperature=1.0)
    in_flight = asyncio.create_task(engine.generate(ids, long))
    await asyncio.sleep(0.05)
    load = asyncio.create_task(engine.load_weights(req))
    for _ in range(2000):  # until the scheduler is paused, waiting for in_flight to drain
        if await engine.llm.is_paused():
            break
        await asyncio.sleep(0.005)
    else:
        pytest.fail("the reload never paused the scheduler")
    assert not in_flight.done(), "the request in flight finished before the pause: nothing drained"
    load.cancel()
    with pytest.raises(asyncio.CancelledError):
        await load
    await asyncio.wait_for(in_flight, 60)
    out = await asyncio.wait_for(engine.generate(ids, Sampling(n=2, max_tokens=8)), 60)
    assert len(out.samples) == 2
    assert engine.version == req.version and {s.policy_version for s in out.samples} == {req.version}


# -- what POST /v1/weights accepts: published versions in the weight store only (issue 12) -----


async def test_a_version_needs_its_sha256(rollout_server, weight_versions):
    async with await _client(rollout_server) as c:
        v = await _version(c)
        req = weight_versions.make(seed=111)
        r = await c.post("/v1/weights", json={"version": req.version, "uri": req.uri})
        assert r.status_code == 422, r.text
        assert [e["loc"] for e in r.json()["detail"]] == [["body", "sha256"]]
        assert await _version(c) == v


async def test_paths_outside_the_weight_store_are_refused(rollout_server, weight_versions, tmp_path):
    """Any readable directory, or a symlink in the store that points out of it, is 403 naming uri,
    even when the registry holds that very path (the store's root is what bounds the reads)."""
    async with await _client(rollout_server) as c:
        v = await _version(c)
        req = weight_versions.make(seed=112)
        outside = tmp_path / "outside"
        shutil.copytree(weight_versions.dir_of(req.version), outside)
        link = weight_versions.root / f"link-{tmp_path.name}"
        link.symlink_to(outside, target_is_directory=True)
        linked_file = weight_versions.root / f"file-link-{tmp_path.name}"
        linked_file.mkdir()
        (linked_file / "model.safetensors").symlink_to(outside / "model.safetensors")
        for path in (outside, link, linked_file):
            body = _published(weight_versions, req.version, path, req.sha256)
            r = await c.post("/v1/weights", json=body)
            assert r.status_code == 403, (path, r.text)
            assert r.json()["detail"].startswith("uri:") and "outside the weight store" in r.json()["detail"]
        r = await c.post("/v1/weights", json={**req.model_dump(), "uri": "/etc"})
        assert r.status_code == 403 and r.json()["detail"].startswith("uri:"), r.text
        assert await _version(c) == v
        weight_versions.register(req.version, weight_versions.dir_of(req.version), req.sha256)
        r = await c.post("/v1/weights", json=req.model_dump())
        assert r.status_code == 200 and r.json()["version"] == req.version, r.text


async def test_only_published_versions_load_and_a_huge_one_cannot_stall_training(rollout_server, weight_versions,
                                                                                 tmp_path):
    """Version 10^12 (or any version the registry lacks) is refused; so is a published version named
    with another path or checksum; the learner's next real version still loads afterwards."""
    from services.wire import LoadWeights

    async with await _client(rollout_server) as c:
        v = await _version(c)
        real = weight_versions.make(seed=113)
        huge = LoadWeights(version=10**12, uri=real.uri, sha256=real.sha256)  # real files, real checksum
        r = await c.post("/v1/weights", json=huge.model_dump())
        assert r.status_code == 403, r.text
        assert r.json()["detail"].startswith(f"version: {10**12} was not published"), r.text
        # a copy of the published files elsewhere in the store is not what was published
        copy = weight_versions.root / f"copy-{tmp_path.name}"
        shutil.copytree(weight_versions.dir_of(real.version), copy)
        r = await c.post("/v1/weights", json={**real.model_dump(), "uri": str(copy)})
        assert r.status_code == 403 and r.json()["detail"].startswith("uri:"), r.text
        other = weight_versions.make(seed=114, version=real.version + 1)  # a valid checksum, of other weights
        r = await c.post("/v1/weights", json={**real.model_dump(), "sha256": other.sha256})
        assert r.status_code == 403 and r.json()["detail"].startswith("sha256:"), r.text
        assert await _version(c) == v
        # training does not stall: the published versions load, in order
        for req in (real, other):
            r = await c.post("/v1/weights", json=req.model_dump())
            assert r.status_code == 200 and r.json()["version"] == req.version, r.text


async def test_without_a_registry_no_version_is_loaded(rollout_engine, serve_app, weight_versions):
    from pydantic import SecretStr

    from rollout_server import build_app
    from rollout_server.settings import RolloutSettings

    token = "no-registry-test-token"
    settings = RolloutSettings(token=SecretStr(token), redis_url=None, run_dir=weight_versions.root)
    async with serve_app(build_app(settings, engine=rollout_engine), token=token) as server:
        async with await _client(server) as c:
            v = await _version(c)
            req = weight_versions.make(seed=115)
            r = await c.post("/v1/weights", json=req.model_dump())
            assert r.status_code == 409 and r.json()["detail"].startswith("version:"), r.text
            assert await _version(c) == v


async def test_without_a_run_id_the_newest_run_speaks(rollout_engine, serve_app, weight_versions, redis_url,
                                                      tmp_path):
    """`tandem up` and the main job: the server has no TANDEM_RUN_ID; the newest run's registry counts
    (the main job makes the server load its final version after the run finished)."""
    import re

    from pydantic import SecretStr

    from broker import Keys, WeightRegistry, WeightVersion, connect
    from rollout_server import build_app
    from rollout_server.settings import RolloutSettings
    from services.runs import RunStore
    from tests.fixtures.control import run_config

    url = re.sub(r"(/\d+)?$", "/6", redis_url, count=1)
    redis = connect(url)
    await redis.flushdb()
    token = "newest-run-test-token"
    try:
        # the run trains a model this server does not serve: its follower leaves it alone
        older, newer = f"older-{tmp_path.name[-8:]}", f"newer-{tmp_path.name[-8:]}"
        store = RunStore(redis)
        await store.create(older, "set", run_config())
        await store.set_state(older, "failed", error="test")
        await store.create(newer, "set", run_config())
        req = weight_versions.make(seed=116)
        record = WeightVersion(version=req.version, uri=str(weight_versions.dir_of(req.version)),
                               sha256=req.sha256, created_at=time.time())
        await WeightRegistry(redis, Keys(older)).publish(record)
        settings = RolloutSettings(token=SecretStr(token), redis_url=url, run_dir=weight_versions.root)
        async with serve_app(build_app(settings, engine=rollout_engine), token=token) as server:
            async with await _client(server) as c:
                r = await c.post("/v1/weights", json=req.model_dump())
                assert r.status_code == 403 and f"run {newer}" in r.json()["detail"], r.text
                await WeightRegistry(redis, Keys(newer)).publish(record)
                r = await c.post("/v1/weights", json=req.model_dump())
                assert r.status_code == 200 and r.json()["version"] == req.version, r.text
    finally:
        await redis.flushdb()
        await redis.aclose()
