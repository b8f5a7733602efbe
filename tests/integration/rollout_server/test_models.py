"""Other architectures through ``tandem serve rollout --model DIR``: a tiny Qwen3-MoE and a
tiny OLMo-3 (random weights, built here), one engine start each (about a minute on 2 CPU cores;
the two servers start together), one test each. The OLMo-3 server runs in ``raw_logprobs`` mode,
which needs an engine start of its own anyway: its test checks that mode's claim (log-softmax of
the raw logits whatever the temperature, top-k and top-p), the Qwen3-MoE test the default mode's."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from deploy.stack import wait_healthy
from host.processes import die_with_parent, free_port, stop_group
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


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """``{kind: (url, model)}``: a ``tandem serve rollout --model`` process per architecture, started
    together (their engine start-ups overlap), each stopped by process group at the end."""
    tmp = tmp_path_factory.mktemp("architectures")
    started = {}
    try:
        for kind, mode in MODES.items():
            model = tiny_arch(kind, tmp / kind)
            port, log = free_port(), tmp / f"{kind}.log"
            env = {**os.environ, "TANDEM_TOKEN": TOKEN, "TANDEM_ROLLOUT_KV_CACHE_GIB": "0.25",
                   "TANDEM_ROLLOUT_DTYPE": "float32", "TANDEM_ROLLOUT_LOGPROBS_MODE": mode}
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "deploy.cli", "serve", "rollout", "--model", str(model), "--port", str(port)],
                    env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
                )
            started[kind] = (proc, f"http://127.0.0.1:{port}", model, log)
        for proc, url, _model, log in started.values():
            wait_healthy(proc, url, 300, log)
        yield {kind: (url, model) for kind, (_proc, url, model, _log) in started.items()}
    finally:
        for proc, *_ in started.values():
            stop_group(proc)


@pytest.mark.long
@pytest.mark.parametrize("kind", list(MODES))
async def test_architecture_serves_with_logprobs_matching_hf(kind, servers):
    import torch
    from transformers import AutoModelForCausalLM

    mode = MODES[kind]
    url, model = servers[kind]
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as c:
        plain = await c.post("/v1/generate", json={"prompt_token_ids": PROMPT_IDS, "n": 2, "max_tokens": 16, "seed": 1})
        truncated = await c.post("/v1/generate", json={"prompt_token_ids": PROMPT_IDS, "n": 2, "max_tokens": 16,
                                                       "seed": 2, **TRUNCATED})
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
