"""The weight store: the on-disk form of a published weight version, and its only definition.

Who talks to whom: the learner writes each version with :func:`write_version`
(through ``learner.retention``) and publishes its URI and checksum in the
broker's weight registry; a rollout server, told ``POST /v1/weights {version,
uri, sha256}``, resolves the URI (:func:`uri_to_path`), checks the checksum
(:func:`verify`) and the tensor names and shapes (:func:`checkpoint_signature`)
in ``rollout_server.transports``, then vLLM loads the directory in place.
Writer and reader both take the format from this module, so it means the same
thing to both. It imports no torch at module level (the writer imports it
when called): the CLI and the rollout server's light modules import it.

**Layout**::

    <root>/v00000042/                  one directory per version (version_dir)
        model.safetensors              every parameter in Hugging Face naming
                                       (model.layers.0.self_attn.q_proj.weight, ...;
                                       a tied lm_head.weight is left out, as
                                       save_pretrained does)
        tandem-version.json            the version record (VersionRecord)
    <root>/.v00000043.tmp-<pid>/       a version being written

A LoRA run that publishes adapters writes PEFT's layout in the same scheme
(``adapter_model.safetensors`` + ``adapter_config.json``, record format
``peft-adapter``). The safetensors metadata carries ``format: pt``,
``tandem_version`` and ``tandem_step``.

**Checksum** (:func:`digest`): the SHA-256 of the bytes of the directory's
``*.safetensors`` files (top level only) concatenated in file-name order;
for a path that is a single file, the SHA-256 of that file. Other files
(the version record, a ``config.json``) are not covered: they are not
loaded into the engine. With one weights file this is just
``sha256sum v00000007/model.safetensors``; in general
``cat $(ls v00000007/*.safetensors | LC_ALL=C sort) | sha256sum``.

**URI**: a plain path or a ``file://`` URI (local disk, a docker-compose
volume, a mounted Modal Volume). Other schemes are for other transports.

**Atomicity**: a version is built under a temporary dot name, fsynced, and
renamed into place (then its parent fsynced), so a reader never sees half a
version and a writer that dies leaves only a temp directory, which
:func:`clean_temp` removes and :func:`on_disk` never lists.

**A full disk** (:class:`RunDirectoryFull`): a version that will not fit in
the free space (``statvfs``: what an unprivileged writer may use) is refused
before a byte is written; one that runs out of space while it is written
(another writer took the space, or the estimate was short: ``ENOSPC`` or
``EDQUOT``) removes its temp directory and raises the same error. Either way
nothing of it stays on disk, the versions already there are untouched, and
the caller (the learner) has nothing to register.

Safetensors files are written and read with the ``safetensors`` library
(``save_file``, ``safe_open``); see :func:`write_safetensors` for the speed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

WEIGHTS_FILE = "model.safetensors"
META_FILE = "tandem-version.json"
WEIGHTS_GLOB = "*.safetensors"
_TEMP_MARK = ".tmp-"
_CHUNK = 16 << 20


class WeightStoreError(Exception):
    """A weight version that is missing, unreadable, malformed or does not match its checksum."""


class RunDirectoryFull(Exception):
    """A version (or ``what`` else) did not fit on the disk of the run directory: nothing of it was left there."""

    def __init__(self, root: Path, free: int, needed: int, what: str = "the version") -> None:
        super().__init__(f"run directory {root} is full: {free} bytes free, {what} needs about {needed}")
        self.root = root
        self.free = free
        self.needed = needed


# -- where versions live ----------------------------------------------------------------


def uri_to_path(uri: str) -> Path:
    """A local path from a plain path or a ``file://`` URI; other schemes raise."""
    parsed = urlparse(uri)
    if parsed.scheme == "":
        return Path(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise WeightStoreError(f"file URI with a remote host is not supported: {uri}")
        return Path(unquote(parsed.path))
    raise WeightStoreError(f"unsupported weight URI scheme {parsed.scheme!r} in {uri!r} (use a path or file://)")


def version_dir(root: str | Path, version: int) -> Path:
    """Where version ``version`` lives under ``root``."""
    return Path(root) / f"v{version:08d}"


def parse_version_dir(path: Path) -> int | None:
    """The version a directory named by :func:`version_dir` holds; None for any other name."""
    name = path.name
    if len(name) == 9 and name[0] == "v" and name[1:].isdigit():
        return int(name[1:])
    return None


def on_disk(root: str | Path) -> list[int]:
    """Versions present under ``root``, ascending (versions being written are not listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(v for p in root.iterdir() if p.is_dir() and (v := parse_version_dir(p)) is not None)


def delete_version(root: str | Path, version: int) -> None:
    shutil.rmtree(version_dir(root, version))


def clean_temp(root: str | Path) -> int:
    """Remove temp directories left by a writer that died mid-write; return how many."""
    root = Path(root)
    if not root.is_dir():
        return 0
    n = 0
    for p in root.iterdir():
        if p.name.startswith(".v") and _TEMP_MARK in p.name:
            shutil.rmtree(p)
            n += 1
    return n


# -- a shared volume under the root -----------------------------------------------------
#
# On Modal the run directory is a Volume mounted in every container; a container
# sees another's writes only after the writer commits and the reader reloads
# (https://modal.com/docs/guide/volumes). The learner commits between writing a version and
# registering it; a rollout server reloads before reading one. ``modal`` is
# imported only here, and only when a volume is named (TANDEM_RUN_DIR_VOLUME).


def commit_volume(name: str) -> None:
    """Persist this container's writes to the mounted Modal Volume ``name`` (blocks; seconds per GB)."""
    import modal

    modal.Volume.from_name(name).commit()


def reload_volume(name: str) -> None:
    """Make the latest commit of the mounted Modal Volume ``name`` visible here. Modal refuses while
    files of the volume are open; the error is raised to the caller, which refuses the version (and
    the follower offers it again)."""
    import modal

    modal.Volume.from_name(name).reload()


# -- the checksum -----------------------------------------------------------------------


def weight_files(path: str | Path) -> list[Path]:
    """The files the checksum covers, in checksum order."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise WeightStoreError(f"no weights at {path}")
    return sorted((p for p in path.glob(WEIGHTS_GLOB) if p.is_file()), key=lambda p: p.name)


def digest(path: str | Path) -> str:
    """The checksum of a version (directory or single file), as defined above."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    for f in weight_files(path):
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                h.update(view[:n])  # releases the GIL: the writer fsyncs meanwhile
    return h.hexdigest()


def total_bytes(path: str | Path) -> int:
    """Bytes of the files the checksum covers."""
    return sum(f.stat().st_size for f in weight_files(path))


def verify(path: str | Path, expected_sha256: str) -> None:
    """Raise :class:`WeightStoreError` unless the version at ``path`` has ``expected_sha256``."""
    files = weight_files(path)
    if not files:
        raise WeightStoreError(f"no {WEIGHTS_GLOB} files in {path}")
    try:
        actual = digest(path)
    except OSError as e:
        raise WeightStoreError(f"unreadable weights at {path}: {e}") from e
    if actual != expected_sha256:
        raise WeightStoreError(
            f"checksum mismatch for {path} ({', '.join(f.name for f in files)}): "
            f"expected {expected_sha256}, got {actual}"
        )


# -- reading ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    """A safetensors file's header: tensor name -> (dtype code such as ``F32``, shape), and metadata."""

    tensors: dict[str, tuple[str, tuple[int, ...]]]
    metadata: dict[str, str]


def read_header(path: str | Path) -> Header:
    """The header of one safetensors file, without reading its tensors.

    ``safe_open`` checks what a load would trip over: a header that is not
    JSON, offsets that disagree with dtype and shape, a file shorter (a
    truncated copy) or longer than its header says. Any of them, or an
    unreadable file, is a :class:`WeightStoreError`.
    """
    from safetensors import SafetensorError, safe_open  # the compiled reader alone: no torch

    path = Path(path)
    try:
        # "numpy" only names the framework get_tensor would return; no tensor is read
        with safe_open(path, framework="numpy") as f:
            tensors = {}
            for name in f.keys():
                info = f.get_slice(name)
                tensors[name] = (info.get_dtype(), tuple(info.get_shape()))
            return Header(tensors, dict(f.metadata() or {}))
    except SafetensorError as e:
        raise WeightStoreError(f"{path.name}: not a valid safetensors file: {e}") from e
    except OSError as e:
        raise WeightStoreError(f"{path.name}: unreadable: {e}") from e


def checkpoint_signature(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over every ``*.safetensors`` file of a version or model directory."""
    files = weight_files(path)
    if not files:
        raise WeightStoreError(f"no {WEIGHTS_GLOB} files in {path}")
    sig: dict[str, tuple[int, ...]] = {}
    for f in files:
        for name, (_dtype, shape) in read_header(f).tensors.items():
            sig[name] = shape
    return sig


@dataclass(frozen=True)
class VersionRecord:
    """``tandem-version.json``: what the writer knew when it wrote the version.

    Informational (for people and tools reading the store): the checksum
    does not cover this file, so a loader trusts the sha256 it was sent,
    never the one recorded here.
    """

    version: int
    step: int
    sha256: str
    bytes: int
    created_at: float
    format: str  # "full" (model.safetensors) or "peft-adapter"


def read_record(path: str | Path) -> VersionRecord:
    """The record of the version directory ``path``."""
    f = Path(path) / META_FILE
    try:
        return VersionRecord(**json.loads(f.read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise WeightStoreError(f"unreadable version record {f}: {e}") from e


# -- writing ----------------------------------------------------------------------------


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


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(path: str | Path, tensors: Mapping[str, object],
                      metadata: Mapping[str, str] | None = None) -> tuple[str, int]:
    """Write ``tensors`` (torch) to ``path`` in safetensors format, fsynced; return (sha256, bytes).

    The library's ``safetensors.torch.save_file`` writes straight from the
    tensors' memory (no copy of the state dict); then the file is fsynced in
    one thread while this one computes :func:`digest` from the page cache
    (both release the GIL), so the digest covers the bytes in the file, not
    the bytes meant for it. ``bench/learner.py`` (100.9 MB of fp32 weights,
    2 cores shared at load 3.5, median of 3 rounds): a :func:`write_version`
    took 0.129 s, 89% of a raw ``dd``-style write (0.115 s); ``save_file`` +
    fsync alone took 0.121 s (96%). The hand-written writer this replaced
    hashed from memory while it wrote and so never read the file back: on
    166 MB, side by side, it took 0.114 s against this one's 0.177 s. Both
    are far above the project's target (50% of raw), so the library writes.

    A tensor may be non-contiguous (it is made contiguous first); two names
    sharing memory (an untied copy of a tied head) are refused by the library.
    """
    from safetensors.torch import save_file

    path = Path(path)
    save_file({name: t.contiguous() for name, t in tensors.items()}, path, metadata=dict(metadata or {}))
    errors: list[BaseException] = []

    def sync() -> None:
        try:
            _fsync(path)
        except BaseException as e:  # re-raised in the calling thread below
            errors.append(e)

    syncer = threading.Thread(target=sync, name="weights-fsync")
    syncer.start()
    try:
        sha = digest(path)
    finally:
        syncer.join()
    if errors:
        raise errors[0]
    return sha, path.stat().st_size


_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
# safetensors' writer (Rust) raises SafetensorError, not OSError: the errno is only in its message
_NO_SPACE_TEXT = re.compile(rf"\(os error (?:{'|'.join(str(n) for n in sorted(_NO_SPACE))})\)")


def free_bytes(path: str | Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s filesystem; None when the
    filesystem reports no capacity at all (some FUSE mounts report zero blocks)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize if st.f_blocks else None


def version_bytes(tensors: Mapping[str, object], extra_files: Mapping[str, str] | None = None) -> int:
    """About how many bytes a version of ``tensors`` takes on disk: the tensor data, a safetensors
    header of at most ~200 bytes per tensor, the record, the extra files, a block per file."""
    data = sum(t.numel() * t.element_size() for t in tensors.values())  # torch tensors
    header = 4096 + sum(len(name) + 200 for name in tensors)
    extra = sum(len(text.encode()) for text in (extra_files or {}).values())
    return data + header + 4096 + extra + 4096 * (2 + len(extra_files or {}))


def _no_space(e: BaseException) -> bool:
    if isinstance(e, OSError):
        return e.errno in _NO_SPACE
    return type(e).__name__ == "SafetensorError" and _NO_SPACE_TEXT.search(str(e)) is not None


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
    """Atomically write version ``version`` under ``root`` (layout and record as above).

    An existing directory for ``version`` is an error unless ``replace``
    (a version written but never registered, found again after a crash).
    ``weights_name`` and ``extra_files`` (name -> text) serve the PEFT
    adapter layout (``adapter_model.safetensors`` + ``adapter_config.json``).
    A write that fails leaves neither the version nor its temp directory;
    one that does not fit (checked first, and ``ENOSPC``/``EDQUOT`` while
    writing) raises :class:`RunDirectoryFull`.
    """
    t0 = time.perf_counter()
    root = Path(root)
    needed = version_bytes(tensors, extra_files)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if _no_space(e):
            raise RunDirectoryFull(root, 0, needed) from e
        raise
    final = version_dir(root, version)
    if final.exists():
        if not replace:
            raise FileExistsError(f"{final} exists: version {version} was already written")
        shutil.rmtree(final)
    tmp = root / f".{final.name}{_TEMP_MARK}{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    free = free_bytes(root)
    if free is not None and free < needed:
        raise RunDirectoryFull(root, free, needed)
    try:
        tmp.mkdir()
        sha, nbytes = write_safetensors(
            tmp / weights_name, tensors,
            {"format": "pt", "tandem_version": str(version), "tandem_step": str(step)},
        )
        record = VersionRecord(version=version, step=step, sha256=sha, bytes=nbytes, created_at=time.time(),
                               format="full" if weights_name == WEIGHTS_FILE else "peft-adapter")
        for name, text in {**(extra_files or {}), META_FILE: json.dumps(asdict(record))}.items():
            with open(tmp / name, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        _fsync(tmp)
        os.rename(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _no_space(e):
            raise RunDirectoryFull(root, free_bytes(root) or 0, needed) from e
        raise
    _fsync(root)
    return Written(version, final, sha, nbytes, time.perf_counter() - t0)
