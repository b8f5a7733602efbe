"""GPU check: the learner's GRPO step as model FLOPs utilisation, the publish rate, and vLLM's rate.

    python bench/gpu.py --out gpu.json                       # one GPU (an H200: a few minutes)
    DS_ACCELERATOR=cpu python bench/gpu.py --tiny --out /tmp/gpu.json   # the same code on CPU, tiny model

On a randomly initialised Qwen3-architecture model (default ~0.5B
parameters: hidden 1024, 32 layers, 16 query / 8 KV heads of 128, MLP 3072,
character vocabulary), built in code since nothing can be downloaded:

1. for ZeRO-2 and ZeRO-3 in bf16, the learner's own ``LearnerEngine.train_step`` on
   synthetic trajectory groups (G = 8, 64-token prompts, 448-token
   completions): tokens/s after warm-up steps, and MFU = tokens/s x 6 x
   parameters / the GPU's dense bf16 peak (``--peak-tflops``, default 989.4
   for an H100/H200 SXM); 6 x N is the usual forward + backward estimate
   (attention FLOPs left out, so MFU is slightly understated);
2. publishing a version as the trainer does: gather the full weights
   (``LearnerEngine.full_state_dict``) and write them with
   ``services.weightstore.write_version`` (safetensors + sha256 + atomic
   rename), in GB/s;
3. if vLLM imports, generation tokens/s of ``LLM.generate`` on the same model
   (bf16, 64 prompts x 256 tokens); otherwise the reason it was skipped;
4. packed against padded micro-batches (``learner.packing``) at the first ZeRO stage, on GRPO-like
   uneven lengths (``bench/packing.py``'s groups, completions up to ``--completion-len``): tokens/s and
   MFU of each, and their ratio;
5. the weight broadcast's rate between two processes (``--broadcast-gb`` of bf16): NCCL between two
   GPUs where there are at least two (NCCL refuses two ranks on one GPU: with one GPU it says so and skips);
   on CPU (``--device cpu``, the dry run of this script) gloo through ``services.weightgroup``, what
   ``publish.transport = "broadcast"`` runs there;
6. that each published version's files hold that version's weights with ZeRO-3 and the broadcast
   transport, whose files are written in the background from the pinned host buffers the next
   publish refills (``bench/publish_versions.py``'s check, with its slow disk; on the CPU dry run the
   buffers' reuse is forced). The script exits 1 if a version's files hold other weights.

    DS_ACCELERATOR=cpu python bench/gpu.py --device cpu --tiny --out /tmp/gpu.json   # the CPU dry run of all six

Figures go to ``--out`` (JSON) and to stdout, with the hardware named.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {  # hidden, layers, heads, kv heads, head dim, MLP
    "full": dict(hidden=1024, layers=32, heads=16, kv_heads=8, head_dim=128, intermediate=3072),
    "tiny": dict(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=192),
}


def build_model(out: Path, size: dict) -> tuple[Path, int]:
    """A random Qwen3 in bf16 at ``out``; returns (path, parameter count)."""
    from examples.tiny import parameter_count, tiny_qwen3

    path = tiny_qwen3(out, **size, max_positions=1024, dtype="bfloat16", tie_embeddings=False)
    return path, parameter_count(path)


def synthetic_groups(vocab: int, n_groups: int, group_size: int, prompt_len: int, completion_len: int, seed: int):
    from services.wire import ScoredSample, TrajectoryGroup

    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        samples = [
            ScoredSample(token_ids=[rng.randrange(3, vocab) for _ in range(completion_len)],
                         logprobs=[-rng.uniform(3.0, 6.0) for _ in range(completion_len)], text="",
                         finish_reason="length", policy_version=0, reward=float(rng.randint(0, 1)), status="ok")
            for _ in range(group_size)
        ]
        samples[0] = samples[0].model_copy(update={"reward": 1.0})
        samples[1] = samples[1].model_copy(update={"reward": 0.0})  # never zero variance
        groups.append(TrajectoryGroup(run_id="bench", group_id=f"b{seed}-{g}", prompt="", prompt_token_ids=prompt,
                                      samples=samples, n=group_size, policy_version=0))
    return groups


def learner_step(model: Path, params: int, stage: int, args, work: Path, *, packing: bool = True,
                 uneven: bool = False, publish: bool = True) -> dict:
    import torch

    from learner.batch import build_batch
    from learner.engine import LearnerEngine
    from services import weightstore
    from services.config import RunConfig

    cfg = RunConfig.model_validate({
        "name": "gpu-bench", "model": {"path": str(model), "max_model_len": 1024},
        "data": {"train": "unused.jsonl"},
        "sampling": {"group_size": args.group_size, "max_tokens": args.completion_len},
        "learner": {"zero_stage": stage, "precision": "bf16", "lr": 1e-5,
                    "micro_batch_tokens": args.micro_batch_tokens, "gradient_checkpointing": args.checkpointing,
                    "packing": packing},
        "loss": {"beta": 0.0},
    })
    engine = LearnerEngine(cfg)
    timed, tokens = [], 0
    for step in range(args.warmup + args.steps):
        if uneven:  # GRPO-like: shared prompts of 16-128 tokens, long-tailed completions (bench/packing.py)
            from bench.packing import grpo_groups

            groups = grpo_groups(engine.vocab_size, args.groups, args.group_size, args.completion_len, seed=step)
        else:
            groups = synthetic_groups(engine.vocab_size, args.groups, args.group_size, args.prompt_len,
                                      args.completion_len, seed=step)
        seqs = build_batch(groups, cfg.loss, cfg.sampling.max_tokens)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        stats = engine.train_step(seqs)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            timed.append(time.perf_counter() - t)
            tokens += sum(s.length for s in seqs)
    tokens_per_s = tokens / sum(timed)
    out = {"zero_stage": stage, "packing": packing, "uneven": uneven, "steps_timed": len(timed), "tokens_per_step": tokens // len(timed),
           "step_s": [round(x, 4) for x in timed], "tokens_per_s": round(tokens_per_s, 1),
           "model_tflops": round(tokens_per_s * 6 * params / 1e12, 2), "loss": stats.get("loss"),
           "micro_batches": stats.get("micro_batches")}
    if args.peak_tflops:
        out["mfu"] = round(tokens_per_s * 6 * params / (args.peak_tflops * 1e12), 4)
    if engine.device.type == "cuda":
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if publish:
        t = time.perf_counter()
        weights = engine.full_state_dict(torch.bfloat16)
        gather_s = time.perf_counter() - t
        written = weightstore.write_version(work / f"weights-zero{stage}", 1, weights, step=1, replace=True)
        out["publish"] = {"bytes": written.bytes, "gather_s": round(gather_s, 3), "write_s": round(written.seconds, 3),
                          "write_gb_per_s": round(written.gb_per_s, 3),
                          "gather_and_write_gb_per_s": round(written.bytes / (gather_s + written.seconds) / 1e9, 3)}
        del weights
    engine.engine.destroy()
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def packed_vs_padded(model: Path, params: int, stage: int, args, work: Path) -> dict:
    """The learner's tokens/s (and MFU) with packed and with padded micro-batches on the same uneven batches."""
    rows = {layout: learner_step(model, params, stage, args, work, packing=layout == "packed", uneven=True,
                                 publish=False) for layout in ("packed", "padded")}
    return {**rows, "packed_over_padded": round(rows["packed"]["tokens_per_s"] / rows["padded"]["tokens_per_s"], 3)}


def _nccl_rank(rank: int, port: int, nbytes: int, repeats: int, out) -> None:
    """One of two processes: NCCL broadcasts of ``nbytes`` from rank 0 on GPU ``rank``; rank 0 reports seconds."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=f"cuda:{rank}")
    dist.broadcast(buf, src=0)  # warm-up: the communicator forms here
    torch.cuda.synchronize()
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        dist.broadcast(buf, src=0)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t)
    if rank == 0:
        out.put(seconds)
    dist.destroy_process_group()


def broadcast_rate(args, device: str) -> dict:
    """Broadcast GB/s between two processes: NCCL on two GPUs, gloo (``services.weightgroup``) on CPU."""
    import torch

    nbytes = int(args.broadcast_gb * 1e9)
    if device == "cpu":
        from bench.transfer import broadcast, make_tensors

        tensors = make_tensors(nbytes, torch.device("cpu"))
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        _, learner_s, member_s = broadcast(tensors)
        return {"backend": "gloo", "bytes": nbytes, "learner_s": round(learner_s, 3), "member_s": round(member_s, 3),
                "gb_per_s": round(nbytes / learner_s / 1e9, 3),
                "note": "services.weightgroup to one member process (sha256 both sides, the group's forming included)"}
    if torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU: NCCL refuses two ranks on the same GPU, so the "
                           "broadcast between two processes needs at least two GPUs"}
    import torch.multiprocessing as mp

    from host.processes import free_port

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_nccl_rank, args=(free_port(), nbytes, 3, out), nprocs=2, join=True, start_method="spawn")
    seconds = out.get()
    best = min(seconds)
    return {"backend": "nccl", "bytes": nbytes, "seconds": [round(x, 4) for x in seconds],
            "gb_per_s": round(nbytes / best / 1e9, 2), "note": "GPU 0 to GPU 1, best of 3 after a warm-up"}


def published_versions(model: Path, args, work: Path) -> dict:
    """Part 6: ``check`` of ``bench/publish_versions.py`` on a ZeRO-3 bf16 engine of the bench model, its host buffers reused."""
    import asyncio

    from bench.publish_versions import check
    from broker.embedded import EmbeddedRedis
    from learner.batch import build_batch
    from learner.engine import LearnerEngine
    from services.config import RunConfig

    cfg = RunConfig.model_validate({
        "name": "gpu-bench-versions", "model": {"path": str(model), "max_model_len": 1024, "dtype": "bfloat16"},
        "data": {"train": "unused.jsonl"},
        "sampling": {"group_size": args.group_size, "max_tokens": args.completion_len},
        "learner": {"zero_stage": 3, "precision": "bf16", "lr": 1e-4, "micro_batch_tokens": args.micro_batch_tokens},
        "loss": {"beta": 0.0}, "publish": {"transport": "broadcast", "keep": 100},
    })
    engine = LearnerEngine(cfg)
    engine.host_buffers = True  # a GPU's path (on the CPU dry run: forced)
    seeds = iter(range(1000, 2000))

    def train() -> None:
        groups = synthetic_groups(engine.vocab_size, 1, args.group_size, args.prompt_len, args.completion_len,
                                  seed=next(seeds))
        engine.train_step(build_batch(groups, cfg.loss, cfg.sampling.max_tokens))

    try:
        with EmbeddedRedis(work / "redis") as redis:
            return asyncio.run(check(engine, cfg, redis.url, work / "versions", train))
    finally:
        engine.engine.destroy()


def generation(model: Path, args) -> dict:
    try:
        from vllm import LLM, SamplingParams
    except ImportError as e:
        return {"skipped": f"vllm is not importable here: {e}"}
    llm = LLM(model=str(model), dtype="bfloat16", enforce_eager=False, gpu_memory_utilization=0.5, seed=0)
    params = SamplingParams(n=1, temperature=1.0, max_tokens=256, ignore_eos=True, seed=0)
    prompts = [{"prompt_token_ids": [5 + i % 50] * 32} for i in range(64)]
    llm.generate(prompts[:4], params)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"prompts": len(prompts), "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1)}


def hardware() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        info |= {"gpu": torch.cuda.get_device_name(0),
                 "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", choices=["auto", "cpu"], default="auto",
                    help="cpu: the dry run (gloo, no MFU); auto: the GPU where there is one.")
    ap.add_argument("--broadcast-gb", type=float, default=4.0, help="Bytes per broadcast (CPU dry run: 0.05).")
    ap.add_argument("--no-packing", action="store_true", help="Skip the packed against padded comparison.")
    ap.add_argument("--tiny", action="store_true", help="A tiny model (a CPU check of the code).")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--groups", type=int, default=8, help="Prompt groups per step.")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--completion-len", type=int, default=448)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--checkpointing", action="store_true", help="Activation checkpointing in the learner.")
    ap.add_argument("--no-generation", action="store_true", help="Skip the vLLM part.")
    ap.add_argument("--peak-tflops", type=float, default=989.4,
                    help="The GPU's dense bf16 peak (H100/H200 SXM: 989.4); 0 = no MFU (CPU).")
    args = ap.parse_args()
    import torch

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        args.peak_tflops, args.broadcast_gb = 0.0, min(args.broadcast_gb, 0.05)
    if args.tiny:
        args.groups, args.group_size, args.prompt_len, args.completion_len = 2, 4, 8, 24
        args.micro_batch_tokens, args.steps, args.warmup = 256, 2, 1
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tandem-gpu-") as tmp:
        work = Path(tmp)
        model, params = build_model(work / "model", SIZES["tiny" if args.tiny else "full"])
        report = {"hardware": hardware(), "parameters": params, "model": SIZES["tiny" if args.tiny else "full"],
                  "batch": {"groups": args.groups, "group_size": args.group_size, "prompt_len": args.prompt_len,
                            "completion_len": args.completion_len, "micro_batch_tokens": args.micro_batch_tokens,
                            "checkpointing": args.checkpointing},
                  "learner": [], "peak_tflops": args.peak_tflops}
        for stage in (int(s) for s in args.stages.split(",")):
            report["learner"].append(learner_step(model, params, stage, args, work))
            print(json.dumps(report["learner"][-1]), flush=True)
        report["generation"] = {"skipped": "--no-generation"} if args.no_generation else generation(model, args)
        report["packing"] = ({"skipped": "--no-packing"} if args.no_packing else
                             packed_vs_padded(model, params, int(args.stages.split(",")[0]), args, work))
        report["broadcast"] = broadcast_rate(args, device)
        report["published_versions"] = published_versions(model, args, work)
        print(json.dumps(report["published_versions"]), flush=True)
    report["device"] = device
    report["wall_s"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    if report["published_versions"]["mismatched"]:
        sys.exit(f"versions {report['published_versions']['mismatched']}: their files hold other weights")


if __name__ == "__main__":
    main()
