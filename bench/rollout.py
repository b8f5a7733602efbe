"""Rollout throughput: raw vLLM vs tandem's rollout server vs Hugging Face generate.

Same locally built model (a random Qwen3 of about 25M parameters with the
character tokenizer), same prompts, same sampling (temperature 1, no top-k /
top-p, sampled-token logprobs on for the two vLLM paths), one run, printed
side by side:

  (a) vLLM offline ``LLM.generate`` (one call with all prompts);
  (b) tandem's ``POST /v1/generate`` under concurrent load: the real
      ``tandem serve rollout --model DIR`` process, one request per prompt
      (``n`` samples each), all in flight at once;
  (c) Hugging Face ``generate`` (what TRL's GRPOTrainer uses without vLLM),
      all prompts in one batch.

Tokens/s counts generated tokens up to and including EOS (a sequence that
stops early adds fewer tokens; HF keeps computing padded rows, which is part
of its cost). Each path is warmed up once, then timed ``--repeats`` times;
the best run is reported. vLLM's CPU backend binds its worker to one core
(``VLLM_CPU_OMP_THREADS_BIND=auto`` on 2 cores reserves the other for the
API process); HF runs with ``--hf-threads`` torch threads (default 1, the
same compute).

Then it times weight reloads through ``POST /v1/weights`` (checksum
verification + drain + in-place reload) against the checkpoint size.

Run:  .venv/bin/python bench/rollout.py            (about 5 minutes on 2 CPU cores)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "Q: 17+25=? A:",
    "Once upon a time",
    "def add(a, b):",
    "The capital of France is",
    "2*3+4=",
    "Translate: hello ->",
    "List three colors:",
    "Sort [3,1,2]:",
]


def build_model(out: Path, seed: int = 0) -> Path:
    from examples.tiny import tiny_qwen3

    return tiny_qwen3(out, hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, intermediate=1536, max_positions=512, seed=seed)


def bench_vllm(model: Path, prompt_ids: list[list[int]], n: int, max_tokens: int, repeats: int) -> tuple[int, float]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), enforce_eager=True, dtype="float32", max_model_len=512, seed=0,
              kv_cache_memory_bytes=1 << 30, disable_log_stats=True)
    params = SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in prompt_ids]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        runs.append((sum(len(c.token_ids) for o in outs for c in o.outputs), dt))
    del llm
    import gc

    gc.collect()
    return max(runs, key=lambda r: r[0] / r[1])


async def _tandem_round(client, prompt_ids, n, max_tokens) -> tuple[int, float]:
    body = dict(n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    rs = await asyncio.gather(*[client.post("/v1/generate", json={**body, "prompt_token_ids": p}) for p in prompt_ids])
    dt = time.perf_counter() - t0
    tokens = 0
    for r in rs:
        r.raise_for_status()
        tokens += sum(len(s["token_ids"]) for s in r.json()["samples"])
    return tokens, dt


BENCH_RUN = "bench-rollout"
"""The run whose weight registry lists the versions the benchmark loads (``/v1/weights`` loads
only published versions under ``TANDEM_RUN_DIR``)."""


def start_server(model: Path, port: int, token: str, log: Path, redis_url: str, run_dir: Path) -> subprocess.Popen:
    env = {
        **os.environ, "TANDEM_TOKEN": token, "TANDEM_ROLLOUT_KV_CACHE_GIB": "1", "TANDEM_ROLLOUT_DTYPE": "float32",
        "TANDEM_LOG_LEVEL": "warning", "REDIS_URL": redis_url, "TANDEM_RUN_ID": BENCH_RUN,
        "TANDEM_RUN_DIR": str(run_dir),
    }
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "serve", "rollout", "--model", str(model), "--port", str(port)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )


async def bench_tandem(url: str, token: str, prompt_ids, n, max_tokens, repeats, versions: list[tuple[int, Path]],
                       redis_url: str):
    import httpx

    from broker import Keys, WeightRegistry, WeightVersion, connect
    from services.weightstore import digest

    redis = connect(redis_url)
    registry = WeightRegistry(redis, Keys(BENCH_RUN))
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=600) as c:
        await _tandem_round(c, prompt_ids, n, max_tokens)  # warm-up
        runs = [await _tandem_round(c, prompt_ids, n, max_tokens) for _ in range(repeats)]
        reloads = []
        for version, d in versions:
            sha = digest(d)
            await registry.publish(WeightVersion(version=version, uri=str(d.resolve()), sha256=sha,
                                                 created_at=time.time()))
            t0 = time.perf_counter()
            r = await c.post("/v1/weights", json={"version": version, "uri": d.as_uri(), "sha256": sha})
            wall = time.perf_counter() - t0
            r.raise_for_status()
            reloads.append((wall, r.json()["reload_s"]))
    await redis.aclose()
    return max(runs, key=lambda r: r[0] / r[1]), reloads


def bench_hf(model: Path, prompt_ids, n, max_tokens, repeats, threads: int) -> tuple[int, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    m = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    pad, eos = m.config.pad_token_id, m.config.eos_token_id
    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompt_ids])[:, None]).long()

    def once() -> tuple[int, float]:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = m.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                max_new_tokens=max_tokens, num_return_sequences=n, pad_token_id=pad, eos_token_id=eos,
            )
        dt = time.perf_counter() - t0
        gen = out[:, width:]
        tokens = 0
        for row in gen.tolist():
            tokens += (row.index(eos) + 1) if eos in row else len(row)
        return tokens, dt

    once()
    return max((once() for _ in range(repeats)), key=lambda r: r[0] / r[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (n)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hf-threads", type=int, default=1)
    ap.add_argument("--reloads", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None, help="keep the model here (default: a temp dir)")
    args = ap.parse_args()

    from broker.embedded import EmbeddedRedis
    from deploy.stack import wait_healthy
    from examples.tiny import char_tokenizer, parameter_count
    from host.processes import free_port, stop_group

    work = args.workdir or Path(tempfile.mkdtemp(prefix="tandem-bench-rollout-"))
    model = work / "model"
    if not (model / "config.json").exists():
        build_model(model)
    params = parameter_count(model)
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    tok = char_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    versions = []
    for i in range(args.reloads):
        d = work / f"v{i + 1}"
        if not d.exists():
            full = build_model(work / f"full{i + 1}", seed=i + 1)
            d.mkdir()
            for f in full.glob("*.safetensors"):
                shutil.copy(f, d / f.name)
        versions.append((i + 1, d))

    print(f"model: {params / 1e6:.1f}M parameters (Qwen3: hidden 512, 8 layers, float32, {size / 1e6:.0f} MB), "
          f"{len(PROMPTS)} prompts x {args.samples} samples x {args.max_tokens} tokens, temperature 1.0", flush=True)

    a = bench_vllm(model, prompt_ids, args.samples, args.max_tokens, args.repeats)
    print(f"(a) done: {a[0]} tokens in {a[1]:.2f}s", flush=True)

    port, token = free_port(), secrets.token_urlsafe(24)
    with EmbeddedRedis(Path(tempfile.mkdtemp(prefix="tandem-bench-redis-"))) as redis_server:
        proc = start_server(model, port, token, work / "server.log", redis_server.url, work)
        try:
            wait_healthy(proc, f"http://127.0.0.1:{port}", 300, work / "server.log")
            b, reloads = asyncio.run(bench_tandem(f"http://127.0.0.1:{port}", token, prompt_ids, args.samples,
                                                  args.max_tokens, args.repeats, versions, redis_server.url))
        finally:
            stop_group(proc)
    print(f"(b) done: {b[0]} tokens in {b[1]:.2f}s", flush=True)

    c = bench_hf(model, prompt_ids, args.samples, args.max_tokens, args.repeats, args.hf_threads)

    rate = {k: v[0] / v[1] for k, v in {"a": a, "b": b, "c": c}.items()}
    print()
    print(f"{'':34s}{'tokens':>8s}{'wall s':>9s}{'tokens/s':>10s}{'vs HF':>8s}")
    for key, label, (tokens, wall) in (
        ("a", "(a) vLLM LLM.generate", a),
        ("b", "(b) tandem /v1/generate (8 conc.)", b),
        ("c", f"(c) HF generate ({args.hf_threads} thread)", c),
    ):
        print(f"{label:34s}{tokens:8d}{wall:9.2f}{rate[key]:10.0f}{rate[key] / rate['c']:7.2f}x")
    print(f"(b)/(a) = {rate['b'] / rate['a']:.2f}   (target >= 0.90)")
    server_s = statistics.median(r[1] for r in reloads)
    wall_s = statistics.median(r[0] for r in reloads)
    print(
        f"weight reload ({len(reloads)}x, {size / 1e6:.0f} MB safetensors): server {server_s:.3f}s = "
        f"{size / server_s / 1e9:.2f} GB/s (sha256 verify + drain + reload), HTTP round trip {wall_s:.3f}s"
    )
    print(json.dumps({"tokens_per_s": rate, "reload_s": server_s, "reload_gb_per_s": size / server_s / 1e9, "params": params}))


if __name__ == "__main__":
    main()
