"""Other architectures through ``tandem serve rollout --model DIR``: a tiny Qwen3-MoE and a
tiny OLMo-3 (random weights, built here), each one engine start (about a minute on 2 CPU
cores), one test each. The OLMo-3 server runs in ``raw_logprobs`` mode, which needs an engine
start of its own anyway: its test checks that mode's claim (log-softmax of the raw logits
whatever the temperature, top-k and top-p), the Qwen3-MoE test the default mode's."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import pytest

from broker.processes import free_port, stop_group
from deploy.stack import wait_healthy
from tests.fixtures.rollout import TOKEN, tiny_arch
from tests.integration.rollout_server.test_logprobs_modes import (
    TRUNCATED,
    completion_logits,
    expected,
    gap,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPT_IDS = [10, 11, 12]
MODES = {"qwen3_moe": "processed_logprobs", "olmo3": "raw_logprobs"}


@pytest.mark.parametrize("kind", list(MODES))
async def test_architecture_serves_with_logprobs_matching_hf(kind, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    mode = MODES[kind]
    model = tiny_arch(kind, tmp_path / kind)
    port = free_port()
    log = tmp_path / "server.log"
    env = {**os.environ, "TANDEM_TOKEN": TOKEN, "TANDEM_ROLLOUT_KV_CACHE_GIB": "0.25", "TANDEM_ROLLOUT_DTYPE": "float32",
           "TANDEM_ROLLOUT_LOGPROBS_MODE": mode}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "serve", "rollout", "--model", str(model), "--port", str(port)],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        await asyncio.to_thread(wait_healthy, proc, f"http://127.0.0.1:{port}", 300, log)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
        ) as c:
            plain = await c.post("/v1/generate", json={"prompt_token_ids": PROMPT_IDS, "n": 2, "max_tokens": 16, "seed": 1})
            truncated = await c.post("/v1/generate", json={"prompt_token_ids": PROMPT_IDS, "n": 2, "max_tokens": 16,
                                                           "seed": 2, **TRUNCATED})
    finally:
        stop_group(proc)
    assert plain.status_code == 200, plain.text
    assert truncated.status_code == 200, truncated.text
    assert plain.json()["logprobs_mode"] == truncated.json()["logprobs_mode"] == mode
    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    for s in plain.json()["samples"]:  # temperature 1, no truncation: both modes are log_softmax(logits)
        logits = completion_logits(hf, PROMPT_IDS, s["token_ids"])
        assert gap(s["logprobs"], expected(logits, s["token_ids"], "raw_logprobs")) < 2e-3
    other = "raw_logprobs" if mode == "processed_logprobs" else "processed_logprobs"
    for s in truncated.json()["samples"]:
        logits = completion_logits(hf, PROMPT_IDS, s["token_ids"])
        assert gap(s["logprobs"], expected(logits, s["token_ids"], mode, **TRUNCATED)) < 2e-3, mode
        assert gap(s["logprobs"], expected(logits, s["token_ids"], other, **TRUNCATED)) > 1e-2, "modes not told apart"
