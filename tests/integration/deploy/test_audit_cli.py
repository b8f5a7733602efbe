"""`tandem audit RUN_ID`: the ledger read from a running stack's Redis, and the errors naming what is missing."""

from __future__ import annotations

import asyncio
import json

from typer.testing import CliRunner

from broker import connect
from broker.ledger import Ledger
from deploy.cli import app


def test_audit_reads_a_live_runs_ledger_from_redis(redis_url, keys, tmp_path, monkeypatch):
    async def write():
        redis = connect(redis_url)
        try:
            ledger = Ledger(redis, keys)
            await ledger.append("queued", "g0", epoch=0, index=0)
            await ledger.append("generated", "g0", server="r1", version=0, statuses={"ok": 2})
            await ledger.append("trained", "g0", step=1, basis=0, version=0)  # no "started": nothing says when
        finally:
            await redis.aclose()

    asyncio.run(write())
    stack = tmp_path / "stack"
    stack.mkdir()
    (stack / "stack.json").write_text(json.dumps({"redis_url": redis_url}))  # the stack's Redis, not REDIS_URL
    monkeypatch.delenv("REDIS_URL", raising=False)
    result = CliRunner().invoke(app, ["audit", keys.run_id, "--run-dir", str(stack), "--json"])
    report = json.loads(result.output)
    assert report["groups"]["queued"] == 1 and report["groups"]["trained"] == 1, report

    unknown = CliRunner().invoke(app, ["audit", "no-such-run", "--run-dir", str(stack)])
    assert unknown.exit_code == 1 and "ledger is empty" in unknown.output
    no_stack = CliRunner().invoke(app, ["audit", keys.run_id, "--run-dir", str(tmp_path / "none")])
    assert no_stack.exit_code == 2 and "no running stack" in no_stack.output
