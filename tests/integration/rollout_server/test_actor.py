"""The actor loop with the real broker (Redis), the session's real vLLM engine and a
scoring service over HTTP. The test plays the learner: it reads trajectory groups,
checks them, publishes a new weight version, then acks (publish-before-ack, so with
eta = 0 no group can be admitted on the old version once a step's groups are in)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid

import pytest

from broker import Admission, Envelope, Stream, WeightRegistry, accept
from broker.weight_versions import WeightVersion
from services import wire
from services.clients import RewardClient
from services.config import RunConfig
from services.reward_specs import RegexSpec
from tests.fixtures.rollout import TOKEN, version_spans

pytestmark = pytest.mark.usefixtures("engine_left_serving")

ALWAYS_FAILS = "this reward function always fails"
"""What ``tests.rewards:failing`` (``reward_service.function_failure_spec``) raises."""


def _config(tiny_model, tmp_path, *, eta: int, groups_per_step: int, group_size: int = 4, retries: int = 2,
            fail_after: int = 8) -> RunConfig:
    train = tmp_path / "train.jsonl"
    train.write_text("")
    return RunConfig.model_validate(
        {
            "name": "actor-test",
            "model": {"path": str(tiny_model), "max_model_len": 256},
            "data": {"train": str(train)},
            "sampling": {"group_size": group_size, "max_tokens": 12, "temperature": 1.0},
            "learner": {"groups_per_step": groups_per_step},
            "staleness": {"max_staleness": eta, "lease_s": 60, "visibility_timeout_s": 60},
            "reward": {"retries": retries, "fail_after": fail_after},
        }
    )


async def _enqueue(redis, keys, count: int, n: int, spec=None) -> list[str]:
    prompts = Stream.prompts(redis, keys)
    await prompts.ensure_group()
    groups = []
    envs = []
    for i in range(count):
        gid = f"g{i}-{uuid.uuid4().hex[:6]}"
        pg = wire.PromptGroup(
            run_id=keys.run_id, group_id=gid, prompt=f"Q{i}: 2+{i}=", n=n, index=i,
            spec=spec or RegexSpec(pattern="a"),
        )
        envs.append(Envelope(gid, -1, wire.encode(pg)))
        groups.append(gid)
    await prompts.add_many(envs)
    return groups


async def _publish(registry: WeightRegistry, weight_versions, seed: int, version: int) -> None:
    req = weight_versions.make(seed=seed, version=version)
    await registry.publish(
        WeightVersion(version=version, uri=req.uri, sha256=req.sha256, created_at=time.time())
    )


class Watch:
    """Samples the admission tickets while the actor runs: never above capacity."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.max_outstanding = 0
        self.watching = True

    async def run(self) -> None:
        # ended by a flag and awaited: once, in a CI run, a cancel() was lost and this polled
        # on until Redis closed at the end of the session ("Task exception was never retrieved")
        while self.watching:
            self.max_outstanding = max(self.max_outstanding, await self.admission.outstanding())
            await asyncio.sleep(0.01)


async def _run_learner(
    redis, keys, registry, weight_versions, *, eta: int, groups_per_step: int, steps: int, hf_logprobs, seed0: int
):
    """A learner stand-in (publish-before-ack). Returns [(v_learner, TrajectoryGroup)]."""
    traj = Stream.trajectories(redis, keys)
    await traj.ensure_group()
    seen = []
    v_learner = await registry.latest_version()
    for step in range(steps):
        batch = []
        deadline = time.monotonic() + 120
        while len(batch) < groups_per_step:
            assert time.monotonic() < deadline, f"step {step}: only {len(batch)} groups arrived"
            batch += await traj.read("learner", count=groups_per_step - len(batch), block_ms=500)
        for d in batch:
            g = wire.decode(wire.TrajectoryGroup, d.envelope.payload)
            assert d.envelope.policy_version == g.policy_version
            seen.append((v_learner, g))
            assert accept(v_learner, g.policy_version, eta), (
                f"admission let through a group of version {g.policy_version} at learner version {v_learner}"
            )
            for s in g.samples:
                assert len(s.logprobs) == len(s.token_ids) and all(math.isfinite(x) for x in s.logprobs)
                # the tags are true: each token's logprob is that of the weights of the version that sampled it
                # (the sample's policy_version, or each span's with in-flight reloads)
                for start, stop, v in version_spans(s):
                    ref = hf_logprobs(weight_versions.dir_of(v), g.prompt_token_ids, s.token_ids)[start:stop]
                    assert max(abs(a - b) for a, b in zip(s.logprobs[start:stop], ref, strict=True)) < 2e-3
        v_learner += 1
        await _publish(registry, weight_versions, seed0 + step, v_learner)
        await traj.ack(batch, counter="accepted")
    return seen


@pytest.fixture
async def actor_factory(rollout_engine, redis, keys, reward_service):
    """Start an Actor on the session engine for this test's run; cancelled at the end."""
    from rollout_server.actor import Actor

    tasks, clients = [], []

    def start(config: RunConfig, concurrency: int = 8, name: str = ""):
        reward = RewardClient(reward_service.url, TOKEN, attempts=2, max_total_s=10)
        clients.append(reward)
        actor = Actor(
            rollout_engine, redis=redis, keys=keys, config=config, reward=reward,
            server_id=f"test-{keys.run_id}{name}", metrics=rollout_engine.metrics, concurrency=concurrency,
        )
        task = asyncio.create_task(actor.run())
        tasks.append(task)
        return actor, task

    yield start
    for t in tasks:
        t.cancel()
    # bounded: a stuck cancellation must fail the test run (with the stacks), not hang it
    if tasks:
        _done, pending = await asyncio.wait(tasks, timeout=30)
        if pending:
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.print_stack(limit=8)
            pytest.fail("the actor did not stop within 30 s of being cancelled")
    for c in clients:
        await c.aclose()


@pytest.mark.parametrize("eta", [0, 2])
async def test_actor_produces_groups_within_the_staleness_bound(
    eta, actor_factory, redis, keys, tiny_model, tmp_path, weight_versions, hf_logprobs, rollout_engine
):
    gps, steps = 2, 3
    config = _config(tiny_model, tmp_path, eta=eta, groups_per_step=gps)
    registry = WeightRegistry(redis, keys)
    # this run's numbering starts above whatever the shared engine has loaded
    v0 = weight_versions.next_version()
    await _publish(registry, weight_versions, 200, v0)
    await _enqueue(redis, keys, count=gps * steps + 4, n=config.sampling.group_size)

    actor, task = actor_factory(config)
    watch = Watch(actor.admission)
    watcher = asyncio.create_task(watch.run())
    try:
        seen = await _run_learner(
            redis, keys, registry, weight_versions, eta=eta, groups_per_step=gps, steps=steps,
            hf_logprobs=hf_logprobs, seed0=210,
        )
    finally:
        watch.watching = False
        await watcher
    assert not task.done(), task.exception() if task.done() and not task.cancelled() else "actor stopped"
    assert watch.max_outstanding <= (eta + 1) * gps
    assert len(seen) == gps * steps
    for v_learner, g in seen:
        assert g.n == config.sampling.group_size == len(g.samples)
        assert g.policy_version == min(s.policy_version for s in g.samples)
        assert g.rollout_id == actor.server_id
        assert {s.reward for s in g.samples} <= {0.0, 1.0}
        if eta == 0:
            # exactly on-policy: every sample of the step producing v+1 comes from v
            assert {s.policy_version for s in g.samples} == {v_learner}
    # the engine followed the published versions (wait for the last reload and its report, however long they take)
    latest = await registry.latest_version()
    deadline = time.monotonic() + 60
    while rollout_engine.version != latest or (await registry.in_use()).get(actor.server_id) != latest:
        assert time.monotonic() < deadline, (rollout_engine.version, await registry.in_use(), latest)
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("failure", ["judge_error", "reward_error"])
async def test_actor_drops_groups_whose_scoring_hits_infrastructure_errors(
    failure, actor_factory, redis, keys, tiny_model, tmp_path, weight_versions, reward_service
):
    """A judge that fails, or a python reward function that raises: the group is scored again
    ``reward.retries`` times, then dead-lettered, never trained with a made-up reward."""
    config = _config(tiny_model, tmp_path, eta=1, groups_per_step=1, retries=2)
    registry = WeightRegistry(redis, keys)
    await _publish(registry, weight_versions, 200, weight_versions.next_version())
    spec = {"judge_error": reward_service.infra_failure_spec, "reward_error": reward_service.function_failure_spec}
    [bad] = await _enqueue(redis, keys, count=1, n=2, spec=spec[failure])
    [good] = await _enqueue(redis, keys, count=1, n=2)
    calls_before = len(reward_service.calls)
    actor, task = actor_factory(config)

    prompts = Stream.prompts(redis, keys)
    traj = Stream.trajectories(redis, keys)
    await traj.ensure_group()
    deadline = time.monotonic() + 60
    got = []
    while time.monotonic() < deadline and not (got and await prompts.dead_letters()):
        got += await traj.read("learner", count=2, block_ms=300)
    assert [wire.decode(wire.TrajectoryGroup, d.envelope.payload).group_id for d in got] == [good]
    dead = await prompts.dead_letters()
    assert [d["g"] for d in dead] == [bad] and "infrastructure" in dead[0]["reason"]
    counters = await redis.hgetall(keys.counters)
    assert int(counters[b"infra_dropped"]) == 1
    # one POST per group, plus the two retries of the failing group (its 2 items each time)
    calls = reward_service.calls[calls_before:]
    bad_calls = [c for c in calls if c[0].startswith(bad)]
    assert len(bad_calls) == 1 + config.reward.retries and all(len(c) == 2 for c in bad_calls)
    assert len([c for c in calls if c[0].startswith(good)]) == 1
    # the dropped group's admission slot was given back: once the actor stops, only the
    # good group's queued ticket remains
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert await actor.admission.counts() == {"queued": 1, "in_flight": 0}


@pytest.mark.parametrize("failure", ["reward_error", "refused"])
async def test_a_reward_that_fails_on_every_group_fails_the_run_with_its_error(
    failure, actor_factory, redis, keys, tiny_model, tmp_path, weight_versions, reward_service
):
    """``reward.fail_after`` groups in a row whose scoring failed (a python reward function that raises every
    time) fail the run with the function's error and an incident; a group scored in between starts the count
    again, so the good group among the first failures keeps it alive. Before: every group was dropped and the
    run waited for data until ``learner.wait_timeout_s`` (600 s), saying nothing."""
    from services.runs import RunStore
    from services.watchdog import IncidentLog

    store = RunStore(redis)
    await store.create(keys.run_id, "p", {})
    await store.set_state(keys.run_id, "running")
    config = _config(tiny_model, tmp_path, eta=4, groups_per_step=4, group_size=2, retries=0, fail_after=3)
    registry = WeightRegistry(redis, keys)
    await _publish(registry, weight_versions, 300, weight_versions.next_version())
    from services.reward_specs import RewardModelSpec

    bad = reward_service.function_failure_spec if failure == "reward_error" else RewardModelSpec(model="absent")
    error, reason = ((ALWAYS_FAILS, "infra") if failure == "reward_error" else
                     ("absent is not a reward model of this reward server", "dead_lettered"))
    # two failures, a scored group, then failures until the run fails: the first two do not count
    order = [*await _enqueue(redis, keys, count=2, n=2, spec=bad), *await _enqueue(redis, keys, count=1, n=2)]
    actor, task = actor_factory(config, concurrency=1)
    deadline = time.monotonic() + 60
    while len(await Stream.prompts(redis, keys).dead_letters()) < 2 or \
            not int((await redis.hgetall(keys.counters)).get(b"produced", 0)):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    assert (await store.get(keys.run_id)).state == "running"  # 2 failed, then one scored: the count restarts
    order += await _enqueue(redis, keys, count=4, n=2, spec=bad)
    while (record := await store.get(keys.run_id)).state == "running":
        assert time.monotonic() < deadline, await Stream.prompts(redis, keys).dead_letters()
        await asyncio.sleep(0.1)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert record.state == "failed"
    assert "the reward failed on 3 groups in a row (reward.fail_after)" in record.error
    assert error in record.error, record.error
    [inc] = await IncidentLog(redis, keys).recent()
    assert inc.field == "reward.fail_after" and inc.limit_s is None and error in inc.on
    assert wire.dropped_by_reason({k.decode(): int(v) for k, v in (await redis.hgetall(keys.counters)).items()}
                                  )[reason] >= 5


async def test_actor_dead_letters_a_malformed_prompt_and_frees_its_slot(
    actor_factory, redis, keys, tiny_model, tmp_path, weight_versions
):
    # capacity (eta + 1) * groups_per_step = 1: if the malformed entry kept its slot, nothing else would run
    config = _config(tiny_model, tmp_path, eta=0, groups_per_step=1)
    await _publish(WeightRegistry(redis, keys), weight_versions, 200, weight_versions.next_version())
    prompts = Stream.prompts(redis, keys)
    await prompts.ensure_group()
    await prompts.add(Envelope("junk", -1, b"\xc1 not msgpack"))
    [good] = await _enqueue(redis, keys, count=1, n=2)
    _actor, _task = actor_factory(config)
    traj = Stream.trajectories(redis, keys)
    await traj.ensure_group()
    got = []
    deadline = time.monotonic() + 60
    while not got:
        assert time.monotonic() < deadline, "the group after the malformed entry never came"
        got = await traj.read("learner", count=1, block_ms=300)
    assert wire.decode(wire.TrajectoryGroup, got[0].envelope.payload).group_id == good
    dead = await prompts.dead_letters()
    assert [d["g"] for d in dead] == ["junk"] and "invalid PromptGroup" in dead[0]["reason"]


async def test_follower_serves_the_active_run_until_it_is_stopped(
    rollout_engine, reward_service, control_db_url, control_redis, tiny_model, tmp_path, caplog
):
    """Stack mode (``rollout_server.follower``): a run of this server's model is served while it is live;
    a run of another model is refused; a run whose config is invalid is failed (``RunWatcher``)."""
    from pydantic import SecretStr

    from broker import Keys
    from rollout_server.actor import cancel_and_wait
    from rollout_server.follower import follow_runs
    from rollout_server.settings import RolloutSettings
    from rollout_server.tools import ToolBox
    from services.runs import MetricsLog, RunStore

    caplog.set_level(logging.INFO, logger="tandem.rollout")
    store = RunStore(control_redis)
    rs = RolloutSettings(redis_url=control_db_url, reward_url=reward_service.url, token=SecretStr(TOKEN),
                         server_id="test-follower", actor_concurrency=4)
    config = _config(tiny_model, tmp_path, eta=1, groups_per_step=1).model_dump(mode="json")

    async def logged(text: str, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in caplog.text:
            assert time.monotonic() < deadline, f"never logged {text!r}:\n{caplog.text[-3000:]}"
            await asyncio.sleep(0.05)

    follower = asyncio.create_task(follow_runs(rollout_engine, rs, rollout_engine.metrics, ToolBox(), poll_s=0.05,
                                               report_s=0.2))
    try:
        await store.create("fw-bad", "ps-x", {**config, "loss": {"eps_hihg": 0.3}})
        await logged("run fw-bad cannot be served")
        bad = await store.get("fw-bad")
        assert bad.state == "failed" and "loss.eps_hihg: unknown field" in bad.error

        await store.create("fw-other", "ps-x", {**config, "model": {**config["model"], "path": str(tmp_path / "other")}})
        await _enqueue(control_redis, Keys("fw-other"), count=1, n=2)
        await logged("not serving run fw-other")
        await asyncio.sleep(0.3)
        assert await Stream.prompts(control_redis, Keys("fw-other")).pending() == 0  # nothing read
        await store.stop("fw-other")

        keys = Keys("fw-1")
        await store.create("fw-1", "ps-x", config)
        await _enqueue(control_redis, keys, count=4, n=2)
        traj = Stream.trajectories(control_redis, keys)
        await traj.ensure_group()
        got = []
        deadline = time.monotonic() + 120
        while len(got) < 2:  # capacity (eta + 1) * groups_per_step = 2: ack to let more in
            assert time.monotonic() < deadline and not follower.done(), f"{len(got)} groups:\n{caplog.text[-3000:]}"
            batch = await traj.read("learner", count=2, block_ms=300)
            await traj.ack(batch, counter="accepted")
            got += batch
        assert {wire.decode(wire.TrajectoryGroup, d.envelope.payload).run_id for d in got} == {"fw-1"}
        deadline = time.monotonic() + 30
        while not [p for p in await MetricsLog(control_redis, keys).read() if p.source == "rollout:test-follower"]:
            assert time.monotonic() < deadline, "no rollout metrics reported"
            await asyncio.sleep(0.1)

        await store.stop("fw-1")
        await logged("run fw-1 is over")
        assert not follower.done()  # it waits for the next run
    finally:
        error = await asyncio.wait_for(cancel_and_wait(follower), 30)
    assert error is None


# -- held-out evaluation on the rollout server ----------------------------------

EVAL_PROMPTS = 24


async def _eval_points(redis, keys) -> list:
    from services.runs import MetricsLog

    return [p for p in await MetricsLog(redis, keys).read() if p.source == "eval"]


async def _wait_points(redis, keys, versions: set[int], task, timeout_s: float = 60) -> dict:
    from services.evaluate import EvalLog

    deadline = time.monotonic() + timeout_s
    while not versions <= set(points := await EvalLog(redis, keys).points()):
        assert not task.done(), task.exception() if not task.cancelled() else "actor cancelled"
        assert time.monotonic() < deadline, f"eval points of {sorted(versions - set(points))} never came; have {points}"
        await asyncio.sleep(0.1)
    return points


def _eval_config(tiny_model, tmp_path) -> RunConfig:
    config = _config(tiny_model, tmp_path, eta=1, groups_per_step=2)
    return config.model_copy(update={"eval": config.eval.model_copy(update={"every": 1})})


async def _store_eval_prompts(redis, keys) -> None:
    from services.evaluate import EvalLog

    await EvalLog(redis, keys).store_prompts(
        [wire.EvalPrompt(prompt=f"{i}+{i}=", spec=RegexSpec(pattern="a")) for i in range(EVAL_PROMPTS)])


async def _serving_new_version_with_eval_prompts(redis, keys, tiny_model, tmp_path, weight_versions, rollout_engine):
    """An eval config, a fresh version published and loaded into the session's engine, the held-out prompts stored."""
    config = _eval_config(tiny_model, tmp_path)
    registry = WeightRegistry(redis, keys)
    start = weight_versions.next_version()
    await _publish(registry, weight_versions, 200, start)
    await rollout_engine.load_weights(await _load_request(registry, start))
    await _store_eval_prompts(redis, keys)
    return config, registry, start


async def test_actor_evaluates_each_due_version_alone_even_when_versions_arrive_at_once(
    actor_factory, redis, keys, tiny_model, tmp_path, weight_versions, rollout_engine
):
    """With ``eval.every = 1`` and three versions published at once while training groups are generated:
    the version served at start and each of the three get one point, of all the held-out prompts. A
    point is recorded only when every sample came from its version, so a load during an evaluation
    (no hold-off) or a version skipped while catching up leaves one missing."""
    config, registry, start = await _serving_new_version_with_eval_prompts(
        redis, keys, tiny_model, tmp_path, weight_versions, rollout_engine)
    await _enqueue(redis, keys, count=8, n=config.sampling.group_size)
    _actor, task = actor_factory(config)
    await _wait_points(redis, keys, {start}, task)
    for i in range(1, 4):
        await _publish(registry, weight_versions, 200 + 10 * (i % 2), start + i)
    points = await _wait_points(redis, keys, {start + i for i in range(4)}, task)
    assert all(p.count == EVAL_PROMPTS for p in points.values())
    assert sorted(p.step for p in await _eval_points(redis, keys)) == [start + i for i in range(4)]


async def test_two_actors_evaluate_each_version_once(
    actor_factory, redis, keys, tiny_model, tmp_path, weight_versions, rollout_engine
):
    """Two actors (on the session's one engine) race for each version: one claims and evaluates it,
    and its point is recorded once; recording it again does nothing."""
    from services.evaluate import EvalLog, EvalResult

    config, registry, start = await _serving_new_version_with_eval_prompts(
        redis, keys, tiny_model, tmp_path, weight_versions, rollout_engine)
    generated = rollout_engine.metrics.registry.get_sample_value
    sample = ("tandem_rollout_requests_total", {"source": "eval", "outcome": "ok"})
    before = generated(*sample) or 0.0
    (a, task_a), (b, task_b) = actor_factory(config, name="-a"), actor_factory(config, name="-b")
    await _wait_points(redis, keys, {start}, task_a)
    await _publish(registry, weight_versions, 210, start + 1)
    points = await _wait_points(redis, keys, {start, start + 1}, task_b)
    await asyncio.sleep(1.0)  # a second evaluation of either version would have finished by now
    assert generated(*sample) - before == 2 * EVAL_PROMPTS  # each version's prompts generated once, by one actor
    claims = {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.evals)).items() if k.startswith(b"claim:")}
    assert set(claims) == {f"claim:{start}", f"claim:{start + 1}"}
    assert {p.by for p in points.values()} <= {a.server_id, b.server_id}
    assert all(points[v].by == claims[f"claim:{v}"] for v in points)
    again = EvalResult(accuracy=1.0, mean_reward=1.0, count=1, versions=frozenset({start}), infra_failures=0)
    assert not await EvalLog(redis, keys).record(start, again, "late")
    assert sorted(p.step for p in await _eval_points(redis, keys)) == [start, start + 1]


async def test_actor_evaluates_several_samples_per_prompt_with_pass_at_k(
    actor_factory, redis, keys, tiny_model, tmp_path, weight_versions, rollout_engine
):
    """``eval.samples = 4`` at temperature 1: each held-out prompt gets four sampled completions, every one
    scored (a python reward function logs what it was given), and the version's point holds mean@4 and
    pass@1/2/4 as Chen et al.'s estimator gives them from those rewards (checked against brute force)."""
    import itertools
    import json

    from services.evaluate import EvalLog
    from services.reward_specs import PythonSpec

    config, _registry, start = await _serving_new_version_with_eval_prompts(
        redis, keys, tiny_model, tmp_path, weight_versions, rollout_engine)
    config = config.model_copy(update={"eval": config.eval.model_copy(update={"samples": 4, "temperature": 1.0})})
    log = tmp_path / "scored.jsonl"
    spec = PythonSpec(function="tests.rewards:even_length", args={"log": str(log)})
    prompts = [f"{i}*{i}=" for i in range(EVAL_PROMPTS)]
    await EvalLog(redis, keys).store_prompts([wire.EvalPrompt(prompt=p, spec=spec) for p in prompts])
    await _enqueue(redis, keys, count=2, n=config.sampling.group_size)
    _actor, task = actor_factory(config)
    point = (await _wait_points(redis, keys, {start}, task))[start]

    scored: dict[str, list[dict]] = {}
    for row in map(json.loads, log.read_text().splitlines()):
        scored.setdefault(row["prompt"], []).append(row)
    assert sorted(scored) == sorted(prompts) and all(len(rows) == 4 for rows in scored.values())
    assert any(len({r["completion"] for r in rows}) > 1 for rows in scored.values())  # sampled, not greedy
    correct = [sum(r["reward"] == 1.0 for r in rows) for rows in scored.values()]
    assert len(set(correct)) > 1  # prompts differ, so pass@k is not trivially 0 or 1

    def brute(k: int) -> float:  # the chance that k of a prompt's 4 completions include a correct one
        per_prompt = [[r["reward"] == 1.0 for r in rows] for rows in scored.values()]
        return sum(sum(any(s) for s in itertools.combinations(ok, k)) / math.comb(4, k)
                   for ok in per_prompt) / len(per_prompt)

    assert (point.samples, point.count) == (4, EVAL_PROMPTS)
    assert point.accuracy == pytest.approx(sum(correct) / (4 * EVAL_PROMPTS))  # mean@4
    assert point.pass_at == pytest.approx({1: brute(1), 2: brute(2), 4: brute(4)})
    [metric] = [p for p in await _eval_points(redis, keys) if p.step == start]
    assert metric.values["pass_at_4"] == pytest.approx(brute(4)) and metric.values["samples"] == 4


async def _load_request(registry: WeightRegistry, version: int) -> wire.LoadWeights:
    wv = await registry.get(version)
    return wire.LoadWeights(version=wv.version, uri=wv.uri, sha256=wv.sha256)


async def test_a_group_cancelled_again_while_it_cleans_up_still_leaves_the_in_flight_gauge(
    rollout_engine, redis, keys, tiny_model, tmp_path, reward_service
):
    """A stopped run's actor is cancelled by its TaskGroup, and again by each sibling that fails meanwhile.
    A cancellation landing in the group's clean-up must not leave ``tandem_rollout_groups_in_flight`` up:
    CI saw the gauge at 1 after a stopped run had gone quiet (tests/e2e/test_stack.py)."""
    from rollout_server.actor import Actor

    gauge = rollout_engine.metrics.groups_in_flight
    reward = RewardClient(reward_service.url, TOKEN, attempts=1, max_total_s=10)
    actor = Actor(rollout_engine, redis=redis, keys=keys, config=_config(tiny_model, tmp_path, eta=1, groups_per_step=1),
                  reward=reward, server_id=f"test-{keys.run_id}", metrics=rollout_engine.metrics)
    started = asyncio.Event()

    async def process(*_args) -> None:  # the group's work: it runs until cancelled
        started.set()
        await asyncio.Event().wait()

    actor._process = process
    before = gauge._value.get()
    try:
        for _ in range(20):  # the clean-up takes a few loop turns (a Redis release, the renewer's end)
            decision = await actor.admission.reserve(rollout_engine.version, timeout_s=5.0)
            started.clear()
            task = asyncio.create_task(actor._group(None, decision.ticket))
            await started.wait()
            while not task.done():  # cancelled at every turn until it has ended, as a TaskGroup's aborts can
                task.cancel()
                await asyncio.sleep(0)
            assert gauge._value.get() == before
    finally:
        await reward.aclose()


async def test_trls_reward_functions_score_a_runs_groups_as_trl_would(
    actor_factory, redis, keys, tiny_model, tmp_path, weight_versions, reward_service
):
    """Inside a run: each sample's reward from TRL's own functions (DAPO's overlong punishment, which reads
    ``completion_ids``; an async function that reads ``trainer_state`` and logs a metric) is what TRL's call
    gives on the same completion, its token ids and the learner's step at the group's version; what the
    function logged reaches the learner's step metrics (``fn_<name>``, ``log_metric``) and its completions table
    (``log_extra``'s columns)."""
    import importlib
    from types import SimpleNamespace

    from learner.trainer import completion_rows, reward_metric_means
    from services.reward_specs import PythonSpec

    pytest.importorskip("trl")
    config = _config(tiny_model, tmp_path, eta=2, groups_per_step=2, group_size=6)
    registry = WeightRegistry(redis, keys)
    version = weight_versions.next_version()
    await _publish(registry, weight_versions, 400, version)
    functions = ["overlong", "schedule"]
    groups = {gid: f for f in functions for gid in await _enqueue(redis, keys, count=1, n=6,
                                                                 spec=PythonSpec(function=f"tests.trl_rewards:{f}"))}
    actor, task = actor_factory(config)
    traj = Stream.trajectories(redis, keys)
    await traj.ensure_group()
    got, deadline = [], time.monotonic() + 90
    while len(got) < len(groups):
        assert time.monotonic() < deadline, await Stream.prompts(redis, keys).dead_letters()
        got += [wire.decode(wire.TrajectoryGroup, d.envelope.payload)
                for d in await traj.read("learner", count=2, block_ms=300)]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    trl = importlib.import_module("tests.trl_rewards")
    for g in got:
        fn = getattr(trl, groups[g.group_id])
        logged: dict[str, list[float]] = {}
        columns: dict[str, list] = {}
        state = SimpleNamespace(global_step=min(g.policy_version * config.publish.every, config.learner.steps),
                                max_steps=config.learner.steps, epoch=0.0)
        out = fn(prompts=[g.prompt] * g.n, completions=[s.text for s in g.samples],
                 completion_ids=[s.token_ids for s in g.samples], trainer_state=state,
                 log_extra=lambda column, values, columns=columns: columns.__setitem__(column, values),
                 log_metric=lambda name, value, logged=logged: logged.setdefault(name, []).append(value))
        expected = await out if asyncio.iscoroutine(out) else out
        assert [s.reward for s in g.samples] == expected, groups[g.group_id]
        assert any(r not in (0.0, -1.0) for r in expected), expected  # computed from the lengths, not a bound
        assert g.reward_metrics == {k: sum(v) / len(v) for k, v in logged.items()}
        assert [s.logged for s in g.samples] == [{c: v[i] for c, v in columns.items()} for i in range(g.n)]
        assert all(row["logged"] == g.samples[i].logged
                   for i, row in enumerate(completion_rows([g], 1, g.n, config.loss.advantage)))
    assert set(reward_metric_means(got)) == {"fn_schedule_progress"}
    assert any(s.logged for g in got for s in g.samples)  # the schedule's groups carry their "tokens" column
