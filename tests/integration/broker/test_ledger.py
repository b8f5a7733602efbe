"""The trajectory ledger against a real Redis: the broker's own operations write it, once per group.

Plays the control plane (enqueue), two rollout servers (one prompt redelivered and handed off by both),
the learner (trained, stale, a bad payload, a repeated acknowledgement as after a resume) and the end
of the run (close_run), then audits the exported file.
"""

from __future__ import annotations

from collections import Counter

from broker import Admission, Envelope, Stream, WeightRegistry, WeightVersion
from broker.ledger import Ledger, read_file
from deploy.audit import audit, audit_file
from learner.trainer import close_run

SHA = "ab" * 32


async def test_every_group_ends_once_and_the_file_audits(redis, keys, tmp_path):
    prompts = Stream.prompts(redis, keys, visibility_timeout_s=0.0)
    trajectories = Stream.trajectories(redis, keys)
    await prompts.ensure_group()
    await trajectories.ensure_group()
    ledger = Ledger(redis, keys)
    gids = [f"e0-{i}" for i in range(8)]
    await prompts.add_many([Envelope(g, -1, b"prompt") for g in gids], details=[{"epoch": 0, "index": i} for i in range(8)])
    await ledger.append("started", pid=1, step=0, version=0, max_staleness=0, groups_per_step=2, lost_steps=0)

    # rollout: e0-0 is read by server a, redelivered to b (visibility 0), and both hand it off
    (first,) = await prompts.read("a", count=1, block_ms=None)
    (again,) = await prompts.read("b", count=1, block_ms=None)
    assert first.envelope.group_id == again.envelope.group_id == "e0-0"
    assert await prompts.handoff(again, trajectories, Envelope("e0-0", 0, b"traj"), server="b", version=0,
                                 statuses={"ok": 2}) is not None
    assert await prompts.handoff(first, trajectories, Envelope("e0-0", 0, b"traj"), server="a", version=0,
                                 statuses={"ok": 2}) is None  # refused: already handed off
    for d in await prompts.read("a", count=3, block_ms=None):  # e0-1..e0-3 handed off, e0-4 dead-lettered
        gid = d.envelope.group_id
        await prompts.handoff(d, trajectories, Envelope(gid, 0, b"traj"), server="a", version=0, statuses={"ok": 2})
    (bad,) = await prompts.read("a", count=1, block_ms=None)
    await prompts.dead_letter(bad, "cannot generate: prompt longer than the context")

    # learner: e0-0, e0-1 trained at step 1 (acknowledged twice, as after a resume); e0-2 stale; e0-3 dead-lettered
    got = {d.envelope.group_id: d for d in await trajectories.read("learner", count=10, block_ms=None)}
    assert sorted(got) == ["e0-0", "e0-1", "e0-2", "e0-3"]
    trained = [got["e0-0"], got["e0-1"]]
    details = [{"step": 1, "basis": 0, "version": 0}] * 2
    for _ in range(2):
        await trajectories.ack(trained, counter="accepted", event="trained", details=details)
    await trajectories.ack([got["e0-2"]], counter="stale_dropped", event="dropped", details={"reason": "stale"})
    await trajectories.dead_letter(got["e0-3"], "token id 99999 beyond the vocabulary")

    # versions: v1 published and loaded, v2 published then retracted; admission refuses the retracted one
    registry = WeightRegistry(redis, keys)
    for v in (1, 2):
        await registry.publish(WeightVersion(version=v, uri=f"/w/{v}", sha256=SHA, created_at=0.0), step=v)
    await ledger.append("loaded", server="a", version=1, sha256=SHA)
    await registry.retract([2], checkpoint_step=1, lost_steps=1)
    admission = Admission(redis, keys, max_staleness=1, groups_per_step=2)
    assert (await admission.try_reserve(2)).reason == "stale" and (await admission.try_reserve(1)).ticket

    path = tmp_path / "ledger.jsonl"
    assert await close_run(redis, keys, "run_finished", path) == 3  # e0-5..e0-7, never read
    assert await close_run(redis, keys, "run_finished", path) == 0  # idempotent
    entries = read_file(path)
    ends = Counter((x["g"], x["e"]) for x in entries if x["e"] in ("trained", "dropped"))
    assert all(n == 1 for n in ends.values()) and {g for g, _ in ends} == set(gids)
    assert [x["g"] for x in entries if x["e"] == "generated"] == ["e0-0", "e0-1", "e0-2", "e0-3"]
    reasons = Counter(x["d"]["reason"] for x in entries if x["e"] == "dropped")
    assert reasons == {"stale": 1, "dead_lettered": 2, "run_finished": 3}

    verdict = audit_file(tmp_path)
    assert verdict.ok, verdict.violations
    assert (verdict.trained, verdict.lost, verdict.trained_twice, verdict.retracted) == (2, 0, 0, [2])
    # the file is the Redis stream: auditing either gives the same verdict
    assert audit(await ledger.read()).as_dict() == verdict.as_dict()
