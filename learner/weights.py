"""Writer side of the weight store: one directory of safetensors per version.

Layout (what a rollout server's ``POST /v1/weights {version, uri, sha256}``
reads): ``<root>/v00000042/model.safetensors`` holding every parameter in
Hugging Face naming (``model.layers.0.self_attn.q_proj.weight``, ...; a
tied ``lm_head.weight`` is left out, as ``save_pretrained`` does), plus
``tandem-version.json`` (version, step, sha256, bytes). vLLM loads it with
``collective_rpc("reload_weights", kwargs={"weights_path": uri})``.

``sha256`` is the checksum ``services.weightstore`` defines (the shared,
torch-free definition both sides use): the SHA-256 of the directory's
``*.safetensors`` files concatenated in file-name order; with one file, the
file's digest. This writer computes it while writing, so a publish reads
nothing back; :func:`digest` (re-exported) recomputes it.

Writes are atomic: the file is written into a temporary sibling directory,
fsynced, and the directory renamed into place (then its parent fsynced), so
a reader never sees a partial version and a crash leaves only a temp
directory that :func:`clean_temp` removes. The safetensors file is written
directly from the tensors' memory (header, then each tensor's bytes: no
intermediate copy of the whole state dict) and hashed in a second thread
while it is written, so publishing runs close to the disk's write speed
(``bench/learner.py`` measures it).

No torch import at module level.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.weightstore import META_FILE, digest  # noqa: F401  (digest re-exported for callers)

WEIGHTS_FILE = "model.safetensors"
CHUNK = 16 << 20

_DTYPES = {
    "torch.float32": "F32",
    "torch.bfloat16": "BF16",
    "torch.float16": "F16",
    "torch.float64": "F64",
    "torch.int64": "I64",
    "torch.int32": "I32",
    "torch.int8": "I8",
    "torch.uint8": "U8",
    "torch.bool": "BOOL",
}


def version_dir(root: str | Path, version: int) -> Path:
    """Where version ``version`` lives under ``root``."""
    return Path(root) / f"v{version:08d}"


def parse_version_dir(path: Path) -> int | None:
    name = path.name
    if len(name) == 9 and name[0] == "v" and name[1:].isdigit():
        return int(name[1:])
    return None


@dataclass(frozen=True)
class Written:
    """A version written to disk."""

    version: int
    path: Path
    sha256: str
    bytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def _tensor_bytes(t) -> memoryview:
    """The raw bytes of a CPU tensor, without a copy when it is already contiguous."""
    import torch

    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _header(tensors: Mapping[str, object], metadata: Mapping[str, str]) -> tuple[bytes, list[memoryview]]:
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    buffers: list[memoryview] = []
    offset = 0
    for name, t in tensors.items():
        dtype = _DTYPES.get(str(t.dtype))
        if dtype is None:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name here")
        buf = _tensor_bytes(t)
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(buf)]}
        offset += len(buf)
        buffers.append(buf)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8-byte alignment with spaces
    return struct.pack("<Q", len(raw)) + raw, buffers


def _chunks(parts: Iterable[memoryview]) -> Iterable[memoryview]:
    for p in parts:
        for i in range(0, len(p), CHUNK):
            yield p[i : i + CHUNK]


def write_safetensors(path: Path, tensors: Mapping[str, object], metadata: Mapping[str, str] | None = None) -> tuple[str, int]:
    """Write ``tensors`` (CPU) to ``path`` in safetensors format, fsynced; return (sha256, bytes).

    The digest is computed by a second thread over the same buffers while
    this one writes them (hashlib and os.write both release the GIL).
    """
    head, buffers = _header(tensors, metadata or {})
    parts = [memoryview(head)] + buffers
    h = hashlib.sha256()
    hash_error: list[BaseException] = []

    def _hash() -> None:
        try:
            for c in _chunks(parts):
                h.update(c)
        except BaseException as e:  # re-raised in the writing thread below
            hash_error.append(e)

    hasher = threading.Thread(target=_hash, name="weights-sha256")
    hasher.start()
    total = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for c in _chunks(parts):
            n = 0
            while n < len(c):
                n += os.write(fd, c[n:])
            total += len(c)
        os.fsync(fd)
    finally:
        os.close(fd)
        hasher.join()
    if hash_error:
        raise hash_error[0]
    return h.hexdigest(), total


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_version(
    root: str | Path,
    version: int,
    tensors: Mapping[str, object],
    *,
    step: int = 0,
    replace: bool = False,
    weights_name: str = WEIGHTS_FILE,
    extra_files: Mapping[str, str] | None = None,
) -> Written:
    """Atomically write version ``version`` under ``root``.

    An existing directory for ``version`` is an error unless ``replace``
    (a version written but never registered, found again after a crash).
    ``weights_name`` and ``extra_files`` (name -> text) serve other layouts
    in the same directory scheme, e.g. a PEFT adapter
    (``adapter_model.safetensors`` + ``adapter_config.json``).
    """
    t0 = time.perf_counter()
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    if final.exists():
        if not replace:
            raise FileExistsError(f"{final} exists: version {version} was already written")
        shutil.rmtree(final)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    sha, nbytes = write_safetensors(
        tmp / weights_name, tensors, {"format": "pt", "tandem_version": str(version), "tandem_step": str(step)}
    )
    for name, text in (extra_files or {}).items():
        with open(tmp / name, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    meta = {"version": version, "step": step, "sha256": sha, "bytes": nbytes, "created_at": time.time(),
            "format": "peft-adapter" if weights_name != WEIGHTS_FILE else "full"}
    (tmp / META_FILE).write_text(json.dumps(meta))
    _fsync_dir(tmp)
    os.rename(tmp, final)
    _fsync_dir(root)
    return Written(version, final, sha, nbytes, time.perf_counter() - t0)


def on_disk(root: str | Path) -> list[int]:
    """Versions present under ``root``, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(v for p in root.iterdir() if p.is_dir() and (v := parse_version_dir(p)) is not None)


def delete_version(root: str | Path, version: int) -> None:
    shutil.rmtree(version_dir(root, version), ignore_errors=False)


def clean_temp(root: str | Path) -> int:
    """Remove temp directories left by a writer that died mid-write; return how many."""
    root = Path(root)
    if not root.is_dir():
        return 0
    n = 0
    for p in root.iterdir():
        if p.name.startswith(".v") and ".tmp-" in p.name:
            shutil.rmtree(p)
            n += 1
    return n


def retained(history: Iterable[int], keep: int, in_use: Iterable[int]) -> tuple[set[int], set[int]]:
    """(versions to keep, versions to delete): the newest ``keep`` and any a server still uses."""
    versions = sorted(set(history))
    keep_set = set(versions[-keep:]) | (set(in_use) & set(versions))
    return keep_set, set(versions) - keep_set
