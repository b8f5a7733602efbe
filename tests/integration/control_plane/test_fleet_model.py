"""A deployment whose rollout servers all serve one model (Modal: the app's run config) refuses a run of another
model with 422 naming the fleet's (TANDEM_CONTROL_FLEET_MODEL), over real HTTP, storing nothing. Before: 201,
and the run never trained (each rollout server skips a run of a model it did not load)."""

from __future__ import annotations

import httpx

from tests.fixtures.control import ARITH_LINES, NO_MODEL, TOKEN, run_config


async def test_a_run_of_another_model_than_the_fleets_is_422_naming_it(serve_control, snapshot, control_redis, tmp_path):
    fleet = tmp_path / "models" / "fleet"
    fleet.mkdir(parents=True)
    async with serve_control(fleet_model=fleet) as url:
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as c:
            body = "\n".join(__import__("json").dumps(x) for x in ARITH_LINES).encode()
            up = await c.post("/v1/prompt-sets", content=body, headers={"Content-Type": "application/x-ndjson"})
            assert up.status_code == 201, up.text
            before = await snapshot(control_redis)
            other = await c.post("/v1/runs", json={"prompt_set_id": up.json()["id"], "config": run_config()})
            assert other.status_code == 422, other.text
            detail = other.json()["detail"]
            assert detail.startswith("model.path:") and str(NO_MODEL) in detail and str(fleet) in detail, detail
            assert await snapshot(control_redis) == before
            same = await c.post("/v1/runs", json={"prompt_set_id": up.json()["id"],
                                                  "config": run_config(model={"path": str(fleet)})})
            assert same.status_code == 201, same.text
