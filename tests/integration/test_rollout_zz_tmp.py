import asyncio
from tests.integration.test_rollout_actor import _config

async def test_fail_with_actor_running(actor_factory, tiny_model, tmp_path):
    actor, task = actor_factory(_config(tiny_model, tmp_path, eta=1, groups_per_step=1))
    await asyncio.sleep(2)
    assert False, "deliberate"
