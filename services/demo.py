"""``tandem demo``: the broker end to end, without models.

Two simulated rollout workers (one fast, one slow) and a simulated learner
exchange real trajectory groups through an embedded Redis under the
staleness bound. Halfway through, a learner consumer "crashes" after
reading a batch and before acking it; its groups are redelivered to the
next reader after the visibility timeout. The demo prints the accounting
and exits non-zero if an invariant broke (a group trained twice, or a
group trained with a lag above eta).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from pathlib import Path

from rich.console import Console
from rich.table import Table

from broker import Admission, Envelope, Keys, Stream, WeightRegistry, accept, connect
from broker.embedded import redis_or_embedded
from services import wire
from services.settings import ServiceSettings

GROUP_SIZE = 4
GROUPS_PER_STEP = 4
TOKENS = 32


def _trajectory(prompt: wire.PromptGroup, version: int, rng: random.Random) -> wire.TrajectoryGroup:
    samples = []
    for _ in range(prompt.n):
        ids = [rng.randrange(100) for _ in range(TOKENS)]
        reward = float(rng.random() < 0.5)
        samples.append(
            wire.ScoredSample(
                token_ids=ids, logprobs=[-rng.random() * 3 for _ in ids], text="x" * len(ids),
                finish_reason="length", policy_version=version, reward=reward,
                status="ok" if reward else "wrong_answer",
            )
        )
    return wire.TrajectoryGroup(
        run_id=prompt.run_id, group_id=prompt.group_id, prompt=prompt.prompt, prompt_token_ids=[1, 2, 3],
        samples=samples, n=prompt.n, policy_version=version,
    )


async def _rollout(name: str, keys: Keys, url: str, eta: int, delay_s: float, stop: asyncio.Event) -> None:
    redis = connect(url)
    prompts, trajectories = Stream.prompts(redis, keys), Stream.trajectories(redis, keys)
    admission = Admission(redis, keys, max_staleness=eta, groups_per_step=GROUPS_PER_STEP)
    registry = WeightRegistry(redis, keys)
    rng = random.Random(name)
    loaded = 0
    while not stop.is_set():
        decision = await admission.reserve(loaded, timeout_s=0.2)
        if decision.reason == "stale":
            loaded = decision.latest_version  # "load" the newest weights
            await registry.report_in_use(name, loaded)
            continue
        if decision.ticket is None:
            continue
        deliveries = await prompts.read(name, count=1, block_ms=200)
        if not deliveries:
            await admission.release(decision.ticket)
            continue
        prompt = wire.decode(wire.PromptGroup, deliveries[0].envelope.payload)
        await asyncio.sleep(delay_s * (0.5 + rng.random()))  # "generate"
        group = _trajectory(prompt, loaded, rng)
        await prompts.handoff(
            deliveries[0], trajectories, Envelope(group.group_id, loaded, wire.encode(group)),
            decision.ticket.token,
        )
    await redis.aclose()


async def _learner(keys: Keys, url: str, eta: int, steps: int, console: Console) -> dict:
    redis = connect(url)
    trajectories = Stream.trajectories(redis, keys, visibility_timeout_s=0.5)
    registry = WeightRegistry(redis, keys)
    version, trained, max_lag = 0, set(), 0
    twice, crashed = 0, False
    table = Table("step", "version", "accepted", "lags", "stale dropped")
    while version < steps:
        batch, lags, dropped = [], [], 0
        while len(batch) < GROUPS_PER_STEP:
            if version == steps // 2 and not crashed:
                # a consumer reads a batch and dies before acking it
                lost = await trajectories.read("learner-crashed", count=GROUPS_PER_STEP, block_ms=2000)
                console.print(f"[yellow]learner consumer crashed holding {len(lost)} groups (never acked)")
                crashed = True
            for d in await trajectories.read("learner", count=GROUPS_PER_STEP - len(batch), block_ms=500):
                group = wire.decode(wire.TrajectoryGroup, d.envelope.payload)
                if accept(version, group.policy_version, eta):
                    batch.append(d)
                    lags.append(version - group.policy_version)
                else:
                    await trajectories.ack([d], counter="stale_dropped")
                    dropped += 1
        await asyncio.sleep(0.1)  # "train"
        for d in batch:
            twice += d.envelope.group_id in trained
            trained.add(d.envelope.group_id)
        version += 1
        await registry.publish(
            wire.WeightVersion(version=version, uri=f"demo://{version}", sha256="0" * 64, created_at=time.time())
        )
        await trajectories.ack(batch, counter="accepted")
        max_lag = max([max_lag, *lags])
        table.add_row(str(version), str(version), str(len(batch)), " ".join(map(str, lags)), str(dropped))
    console.print(table)
    counters = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.counters)).items()}
    await redis.aclose()
    return {"trained_twice": twice, "max_observed_lag": max_lag, **counters}


async def _main(steps: int, eta: int, url: str, console: Console) -> dict:
    keys = Keys(f"demo-{uuid.uuid4().hex[:8]}")
    redis = connect(url)
    prompts = Stream.prompts(redis, keys)
    await prompts.ensure_group()
    await Stream.trajectories(redis, keys).ensure_group()
    n_prompts = steps * GROUPS_PER_STEP * 3
    await prompts.add_many([
        Envelope(f"g{i}", -1, wire.encode(wire.PromptGroup(
            run_id=keys.run_id, group_id=f"g{i}", prompt=f"{i}+{i}=",
            spec=wire.ExactSpec(answer=str(2 * i)), n=GROUP_SIZE, index=i,
        )))
        for i in range(n_prompts)
    ])
    await redis.aclose()
    stop = asyncio.Event()
    workers = [
        asyncio.create_task(_rollout("rollout-fast", keys, url, eta, 0.02, stop)),
        asyncio.create_task(_rollout("rollout-slow", keys, url, eta, 0.3, stop)),
    ]
    try:
        return await _learner(keys, url, eta, steps, console)
    finally:
        stop.set()
        await asyncio.gather(*workers)


def run_demo(steps: int, max_staleness: int, run_dir: Path) -> int:
    """Run the demo against an embedded Redis in ``run_dir``; return the exit code."""
    console = Console()
    external = ServiceSettings().redis_url
    with redis_or_embedded(external, run_dir / "redis") as url:
        where = "REDIS_URL" if external else f"embedded redis-server, AOF in {run_dir / 'redis'}"
        console.print(f"broker: {url} ({where})")
        result = asyncio.run(_main(steps, max_staleness, url, console))
    table = Table("counter", "value", title=f"accounting (eta = {max_staleness})")
    for k in ["accepted", "stale_dropped", "redelivered", "duplicates", "dead_lettered", "produced",
              "admitted", "refused_stale", "max_observed_lag", "trained_twice"]:
        table.add_row(k, str(result.get(k, 0)))
    console.print(table)
    ok = result["trained_twice"] == 0 and result["max_observed_lag"] <= max_staleness
    console.print("[green]invariants hold" if ok else "[red]invariant broken")
    return 0 if ok else 1
