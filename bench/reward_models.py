"""Benchmark: scoring throughput of a reward model beside the rule-based rewards, on CPU.

Scores ``--groups`` groups of G = 8 completions (the example's group size), one ``POST /v1/score`` per
group as a rollout server sends them, through the reward server's app in this process (its worker
processes are its own): with ``exact`` (the example's reward), ``math`` (math-verify, in its workers) and
``reward_model`` (a one-label sequence classifier built in code on the example's architecture: a tiny
Qwen3 with its char tokenizer; random weights, so the figure is the cost, not a judgement). Prints
samples/s and CPU-ms per sample (this process and its workers) side by side.

    .venv/bin/python bench/reward_models.py [--groups N] [--hidden H] [--layers L]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from pydantic import SecretStr  # noqa: E402

from host.cpu import CpuMeter, descendants  # noqa: E402

G = 8
TOKEN = "bench-reward-models-token"


def build_reward_model(out: Path, hidden: int, layers: int) -> Path:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from examples.tiny import CHAT_TEMPLATE, tiny_qwen3

    base = tiny_qwen3(out / "base", hidden=hidden, layers=layers, heads=4, kv_heads=2, head_dim=hidden // 4,
                      chat_template=CHAT_TEMPLATE)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(base, num_labels=1).save_pretrained(out / "rm")
    AutoTokenizer.from_pretrained(base).save_pretrained(out / "rm")
    return out / "rm"


def groups(n: int, spec: dict) -> list[list[dict]]:
    rng = random.Random(0)
    out = []
    for g in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append([{"id": f"{g}:{i}", "prompt": f"{a}+{b}=",
                     "completion": f"<answer>{a + b + rng.choice([0, 0, 1, -1])}</answer>", "spec": spec}
                    for i in range(G)])
    return out


async def measure(client: httpx.AsyncClient, label: str, work: list[list[dict]]) -> tuple[float, float]:
    """(samples/s, CPU-ms per sample) of scoring ``work``, a request per group, one at a time."""
    await client.post("/v1/score", json={"items": work[0]})  # warm: workers started, models loaded
    meter = CpuMeter()
    before = sum(meter.sample(descendants([os.getpid()])).values())
    t0 = time.perf_counter()
    for items in work:
        resp = await client.post("/v1/score", json={"items": items})
        resp.raise_for_status()
        assert all(r["reward"] is not None for r in resp.json()["results"]), resp.text
    wall = time.perf_counter() - t0
    cpu = sum(meter.sample(descendants([os.getpid()])).values()) - before
    samples = len(work) * G
    print(f"{label:<16} {samples / wall:10.0f} {1000 * cpu / samples:12.3f}", flush=True)
    return samples / wall, 1000 * cpu / samples


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=128, help="the reward model's hidden size (the example policy's: 128)")
    ap.add_argument("--layers", type=int, default=4, help="its layers (the example policy's: 4)")
    args = ap.parse_args()
    from reward_server.app import build_app
    from reward_server.settings import RewardSettings

    with tempfile.TemporaryDirectory() as tmp:
        rm = build_reward_model(Path(tmp), args.hidden, args.layers)
        settings = RewardSettings(token=SecretStr(TOKEN), sandbox="none", models={"rm": rm}, math_workers=1)
        app = build_app(settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://reward", timeout=300,
                                         headers={"Authorization": f"Bearer {TOKEN}"}) as client:
                print(f"{args.groups} groups of {G}, a request each; reward model: tiny Qwen3, hidden "
                      f"{args.hidden}, {args.layers} layers, CPU, batch {settings.model_batch_size}")
                print(f"{'reward':<16} {'samples/s':>10} {'CPU-ms/sample':>12}")
                for label, spec in (("exact", {"type": "exact", "answer": "42", "extract": "answer_tag"}),
                                    ("math", {"type": "math", "answer": "42"}),
                                    ("reward_model", {"type": "reward_model", "model": "rm"})):
                    await measure(client, label, groups(args.groups, spec))


if __name__ == "__main__":
    asyncio.run(main())
