"""How a weight version reaches the rollout servers: the pieces of each transport, measured.

    python bench/transfer.py --gb 16 --out transfer.json      # a GPU machine: a full 8B version in bf16
    python bench/transfer.py --gb 0.25 --out /tmp/t.json      # CPU: the same code, small

A full-parameter Qwen3-8B version is 16.4 GB in bf16 (``deploy/presets.py``). On ``--gb`` of
bf16 tensors in 256 MB pieces (layer-sized) on the GPU (CPU without one), it times:

1. ``d2h_pageable`` / ``d2h_pinned``: device-to-host copy into ordinary and into pinned memory
   (the gather's floor: ``LearnerEngine.full_state_dict`` copies into ordinary memory today);
2. ``write``: ``services.weightstore.write_version`` to local disk (safetensors + fsync + sha256 +
   atomic rename), what the learner does for every version;
3. ``verify`` and ``read``: the rollout side, ``weightstore.verify`` (sha256 of the files) and
   ``safe_open`` of every tensor onto the device (page cache warm: an upper bound; on Modal the
   reader reads from the Volume, documented at up to ~2.5 GB/s: docs/modal.md, "How it behaves there");
4. ``http``: the version file streamed over loopback HTTP (stdlib server, 8 MiB chunks) into a
   file with sha256 on the fly: the ceiling of a learner serving its versions directly (Modal's
   i6pn network between containers is documented at >= 50 Gbit/s = 6.25 GB/s, and one learner
   sends every rollout server its own copy);
5. the LoRA adapter of the same model (rank 16 on q/k/v/o, bf16) in bytes, timed at the measured
   write rate;
6. ``broadcast``: ``services.weightgroup`` streaming the host copy to one rollout-side process over
   torch.distributed gloo on this machine (``publish.transport = "broadcast"``): the learner's
   seconds (``send``, until the member confirmed the digest) and the member's (join, receive, digest).

It prints each rate side by side and, for the three transports, the seconds a version costs the
learner (its critical path) and the seconds until one rollout server holds it.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import http.server
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services import weightstore  # noqa: E402

PIECE_BYTES = 256 << 20
CHUNK = 8 << 20
VOLUME_GB_PER_S = 2.5
"""Modal's documented Volume throughput ("up to about 2.5 GB/s"), not measured here."""
I6PN_GB_PER_S = 50 / 8
"""Modal's documented container-to-container rate (>= 50 Gbit/s), not measured here."""


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def make_tensors(nbytes: int, device):
    import torch

    piece = min(PIECE_BYTES, nbytes)
    n = max(1, nbytes // piece)
    return {f"model.layers.{i}.weight": torch.randn(piece // 2, dtype=torch.bfloat16, device=device)
            for i in range(n)}


MEMBER = """
import sys, time
import torch.distributed
from services.weightgroup import WeightGroup, broadcast_key
print("ready", flush=True)
sys.stdin.readline()  # started like a vLLM worker: already running when the announcement comes
t0 = time.perf_counter()
tensors, digest = WeightGroup("127.0.0.1", int(sys.argv[1]), 1, 2, key=broadcast_key(None), timeout_s=600.0,
                              name="bench").receive()
print(time.perf_counter() - t0, digest, flush=True)
"""


def broadcast(tensors) -> tuple[str, float, float]:
    """Stream ``tensors`` (host) to one member process over gloo; (digest, learner seconds, member seconds)."""
    import subprocess

    from services.weightgroup import WeightGroup, broadcast_key

    group = WeightGroup("127.0.0.1", 0, 0, 2, key=broadcast_key(None), timeout_s=600.0, name="bench")
    root = str(Path(__file__).resolve().parents[1])
    member = subprocess.Popen([sys.executable, "-c", MEMBER, str(group.port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": root},
                              start_new_session=True)
    try:
        assert member.stdout.readline().strip() == "ready"
        t0 = time.perf_counter()
        member.stdin.write("go\n")
        member.stdin.flush()
        digest = group.send(tensors)  # the group forms when the member joins: its join is in learner_s
        learner_s = time.perf_counter() - t0
        member_s, member_digest = member.communicate(timeout=600)[0].split()
    finally:
        member.kill()
        member.wait()
    assert member_digest == digest, "the member received other bytes"
    return digest, learner_s, float(member_s)


def device_to_host(tensors, pinned: bool, device) -> tuple[dict, float]:
    import torch

    if device.type != "cuda":
        (out, s) = timed(lambda: {k: t.clone() for k, t in tensors.items()})
        return out, s
    bufs = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for k, t in tensors.items()}
    sync(device)
    t0 = time.perf_counter()
    for k, t in tensors.items():
        bufs[k].copy_(t, non_blocking=pinned)
    sync(device)
    return bufs, time.perf_counter() - t0


def read_all(path: Path, device) -> float:
    from safetensors import safe_open

    t0 = time.perf_counter()
    for f in weightstore.weight_files(path):
        with safe_open(str(f), framework="pt", device=str(device)) as st:
            for name in st.keys():
                st.get_tensor(name).sum()  # touch every byte (a CPU tensor is a lazy mmap)
    sync(device)
    return time.perf_counter() - t0


def http_stream(src: Path, dst: Path) -> tuple[str, float]:
    """Serve ``src`` over loopback HTTP and stream it into ``dst``; (sha256, seconds)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            self.send_response(200)
            self.send_header("Content-Length", str(src.stat().st_size))
            self.end_headers()
            with open(src, "rb") as f:
                while chunk := f.read(CHUNK):
                    self.wfile.write(chunk)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=600)
        conn.request("GET", "/model.safetensors")
        resp = conn.getresponse()
        h = hashlib.sha256()
        with open(dst, "wb") as out:
            while chunk := resp.read(CHUNK):
                h.update(chunk)
                out.write(chunk)
        seconds = time.perf_counter() - t0
    finally:
        server.shutdown()
    return h.hexdigest(), seconds


def lora_adapter_bytes(rank: int = 16) -> int:
    from deploy.plan import lora_params
    from deploy.presets import preset

    return int(lora_params(preset("Qwen3-8B-Base"), rank) * 2)


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=None, help="version size in GB (default: 16 on a GPU, 0.25 on CPU)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gb = args.gb or (16.0 if device.type == "cuda" else 0.25)
    lora = lora_adapter_bytes()
    report: dict = {"hardware": {"python": platform.python_version(), "torch": torch.__version__,
                                 "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None},
                    "device": device.type}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        tensors = make_tensors(int(gb * 1e9), device)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        report["bytes"] = nbytes
        _, pageable_s = device_to_host(tensors, pinned=False, device=device)
        host, pinned_s = device_to_host(tensors, pinned=True, device=device)
        del tensors
        written = weightstore.write_version(work / "weights", 1, host, step=1)
        _, broadcast_s, member_s = broadcast(host)
        del host
        _, verify_s = timed(lambda: weightstore.verify(written.path, written.sha256))
        read_s = read_all(written.path, device)
        sha, http_s = http_stream(written.path / weightstore.WEIGHTS_FILE, work / "received.safetensors")
        assert sha == written.sha256, "the HTTP copy differs from the version"
    rate = {"d2h_pageable": nbytes / pageable_s, "d2h_pinned": nbytes / pinned_s, "write": written.bytes / written.seconds,
            "verify": nbytes / verify_s, "read": nbytes / read_s, "http_loopback": nbytes / http_s,
            "broadcast": nbytes / broadcast_s}
    report["gb_per_s"] = {k: round(v / 1e9, 3) for k, v in rate.items()}
    report["seconds"] = {"d2h_pageable": round(pageable_s, 3), "d2h_pinned": round(pinned_s, 3),
                         "write": round(written.seconds, 3), "verify": round(verify_s, 3), "read": round(read_s, 3),
                         "http_loopback": round(http_s, 3), "broadcast": round(broadcast_s, 3)}
    gather = pageable_s  # what full_state_dict pays today
    volume = nbytes / (VOLUME_GB_PER_S * 1e9)
    link = nbytes / min(rate["http_loopback"], I6PN_GB_PER_S * 1e9)
    report["transports"] = {
        "volume": {"learner_s": gather + written.seconds + volume,
                   "rollout_s": volume + verify_s + read_s, "note": "commit and read at the documented 2.5 GB/s"},
        "http_stream": {"learner_s": gather, "rollout_s": link + read_s,
                        "note": "per rollout server, the learner's NIC shared by all of them"},
        "files_local": {"learner_s": gather + written.seconds, "rollout_s": verify_s + read_s,
                        "note": "this machine's disk, no volume: publish.transport = files"},
        "broadcast": {"learner_s": gather + broadcast_s, "rollout_s": member_s, "files_behind_s": written.seconds,
                      "note": "gloo to one member; the files are written in the background meanwhile "
                              "(learner.publisher), files_behind_s after the broadcast"},
        "lora_adapter": {"bytes": lora, "learner_s": lora / rate["write"] + lora / (VOLUME_GB_PER_S * 1e9),
                         "rollout_s": lora / (VOLUME_GB_PER_S * 1e9)},
    }
    print(f"{nbytes / 1e9:.2f} GB of bf16 on {report['hardware']['gpu'] or 'cpu'}")
    print(f"{'piece':16} {'seconds':>8} {'GB/s':>7}")
    for k in rate:
        print(f"{k:16} {report['seconds'][k]:>8.2f} {report['gb_per_s'][k]:>7.2f}")
    print(f"{'transport':14} {'learner s':>10} {'rollout s':>10}")
    for k, v in report["transports"].items():
        print(f"{k:14} {v['learner_s']:>10.2f} {v['rollout_s']:>10.2f}")
    print(f"(LoRA rank-16 adapter of Qwen3-8B: {lora / 1e6:.1f} MB)")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
