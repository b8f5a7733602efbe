"""Each published version's files hold the weights of the version they name (ZeRO-3, broadcast, a slow disk).

    DS_ACCELERATOR=cpu python bench/publish_versions.py --reuse-buffers --out /tmp/versions.json  # CPU
    python bench/publish_versions.py --out versions.json                                         # a GPU

``learner.publisher.Publisher`` with ``publish.transport = "broadcast"`` writes a version's files in the
background while the learner trains on; on a GPU the weights it writes are host buffers that the next
publish's gather refills (``LearnerEngine._to_host``), and the sha256 is taken from the file, so a
version written late would carry the next version's bytes under its own name with a valid digest.
This script publishes ``--versions`` versions of a ZeRO-3 ``LearnerEngine`` through the real
``Publisher`` (a private ``redis-server`` for its registry, no broadcast member: the files are the way
every server that missed the broadcast, a resume and ``tandem export`` read a version), with one
``train_step`` between two, each write held ``--write-delay-s`` before it starts (a slow disk's
stand-in), then compares each version's files with a copy of the weights taken right after that
version was published. ``--reuse-buffers`` runs the GPU's buffer path on CPU. It exits 1 if any version
differs. ``bench/gpu.py`` runs :func:`check` on the GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.embedded import EmbeddedRedis  # noqa: E402


def fingerprint(tensors: dict) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def slow_writes(delay_s: float) -> Iterator[None]:
    """Every ``services.weightstore.write_version`` starts ``delay_s`` late (the publisher looks it up per call)."""
    from services import weightstore as store

    real = store.write_version

    def late(*args, **kwargs):
        time.sleep(delay_s)
        return real(*args, **kwargs)

    store.write_version = late
    try:
        yield
    finally:
        store.write_version = real


def expected(engine, dtype) -> str:
    """The fingerprint of the engine's weights now, gathered into fresh tensors (no shared host buffer)."""
    reuse, engine.host_buffers = engine.host_buffers, False
    try:
        return fingerprint(engine.full_state_dict(dtype))
    finally:
        engine.host_buffers = reuse


async def check(engine, cfg, redis_url: str, work: Path, train: Callable[[], object], *, versions: int = 3,
                write_delay_s: float = 2.0) -> dict:
    """Publish ``versions`` versions through the real ``Publisher`` (``train()`` between two), then compare each
    version's files with the weights it was published with. ``mismatched``: the versions whose files differ."""
    import torch
    from safetensors.torch import load_file

    from broker import Keys, WeightRegistry, connect
    from learner.publisher import Publisher
    from learner.settings import LearnerSettings
    from learner.status import Status
    from services import weightstore as store
    from services.timeline import Timeline

    assert cfg.publish.transport == "broadcast", "the files are written in the background only with a broadcast"
    dtype = getattr(torch, cfg.model.dtype)
    work.mkdir(parents=True, exist_ok=True)
    redis, keys = connect(redis_url), Keys(f"publish-versions-{os.getpid()}")
    weights, registry = work / "weights", WeightRegistry(redis, keys)
    publisher = Publisher(engine, cfg, LearnerSettings(), redis, keys, registry, weights=weights,
                          published_log=work / "published.jsonl", status=Status(), metrics=None,
                          timeline=Timeline.off())
    published: dict[int, str] = {}
    try:
        with slow_writes(write_delay_s):
            for version in range(1, versions + 1):
                if version > 1:
                    train()  # while the previous version's files are being written, as the trainer's next step
                await publisher.publish(version, step=version, resume=False)
                published[version] = expected(engine, dtype)
                await asyncio.sleep(0)  # the background write starts (the trainer awaits its feeder next)
            await publisher.written()
        registered = {v: (await registry.get(v)).sha256 for v in published}
    finally:
        await redis.aclose()
    on_disk = {}
    for version in published:
        path = store.version_dir(weights, version)
        store.verify(path, registered[version])  # what a server checks: valid either way, it is the file's own
        on_disk[version] = fingerprint({k: v for f in store.weight_files(path) for k, v in load_file(f).items()})
    mismatched = [v for v in published if on_disk[v] != published[v]]
    return {"versions": versions, "write_delay_s": write_delay_s, "host_buffers": engine.host_buffers,
            "zero_stage": engine.zero_stage, "device": str(engine.device), "mismatched": mismatched,
            "distinct_versions": len(set(published.values()))}


async def run(args, work: Path, redis_url: str) -> dict:
    from bench.gpu import synthetic_groups
    from examples.tiny import tiny_qwen3
    from learner.batch import build_batch
    from learner.engine import LearnerEngine
    from services.config import RunConfig

    model = args.model or tiny_qwen3(work / "model", hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32,
                                     intermediate=192, max_positions=256, dtype="bfloat16", tie_embeddings=False)
    cfg = RunConfig.model_validate({
        "name": "publish-versions", "model": {"path": str(model), "max_model_len": 256, "dtype": "bfloat16"},
        "data": {"train": "unused.jsonl"}, "sampling": {"group_size": 4, "max_tokens": 16},
        "learner": {"zero_stage": 3, "lr": 1e-2, "micro_batch_tokens": 1024},
        "publish": {"transport": "broadcast", "keep": 100},
    })
    engine = LearnerEngine(cfg)
    engine.host_buffers = engine.host_buffers or args.reuse_buffers
    steps = iter(range(1, 1000))

    def train() -> None:
        groups = synthetic_groups(engine.vocab_size, 1, 4, 8, 8, seed=next(steps))
        engine.train_step(build_batch(groups, cfg.loss, cfg.sampling.max_tokens))

    try:
        return await check(engine, cfg, redis_url, work, train, versions=args.versions, write_delay_s=args.write_delay_s)
    finally:
        engine.engine.destroy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--write-delay-s", type=float, default=2.0, help="Each version's write starts this late.")
    ap.add_argument("--reuse-buffers", action="store_true", help="The GPU's reused host buffers, on CPU.")
    ap.add_argument("--model", type=Path, default=None, help="A model directory (default: a tiny Qwen3 built here).")
    ap.add_argument("--workdir", type=Path, default=None, help="Where the model and versions go (default: a temp dir).")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-versions-", dir=args.workdir) as tmp:
        with EmbeddedRedis(Path(tmp) / "redis") as redis:
            report = asyncio.run(run(args, Path(tmp), redis.url))
    print(json.dumps(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    sys.exit(1 if report["mismatched"] else 0)


if __name__ == "__main__":
    main()
