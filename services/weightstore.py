"""The on-disk form of a published weight version, shared by writer and reader.

The learner writes each version as a directory (``<root>/v00000007/``)
holding the weights as ``*.safetensors`` in Hugging Face naming, plus
``tandem-version.json`` (version, step, sha256, bytes); it publishes the
directory's URI and checksum in the broker's registry. Rollout servers
resolve the URI, verify the checksum and load the directory in place. Both
sides use this module (or, on the writer side, code that computes the same
digest while it writes), so the checksum means the same thing to both. It
imports no torch.

**Checksum** (:func:`digest`): the SHA-256 of the bytes of the directory's
``*.safetensors`` files (top level only) concatenated in file-name order;
for a path that is a single file, the SHA-256 of that file. Other files
(the version record, a ``config.json``) are not covered: they are not
loaded into the engine. With one weights file this is just
``sha256sum v00000007/model.safetensors``; in general
``cat $(ls v00000007/*.safetensors | LC_ALL=C sort) | sha256sum``.

**URI**: a plain path or a ``file://`` URI (local disk, a docker-compose
volume, a mounted Modal Volume). Other schemes are for other transports.

Writers build a version under a temporary name (a dot name) and rename it
into place, so a reader never sees half a version.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from urllib.parse import unquote, urlparse

META_FILE = "tandem-version.json"
WEIGHTS_GLOB = "*.safetensors"
_CHUNK = 16 << 20


class WeightStoreError(Exception):
    """A weight version that is missing, unreadable or does not match its checksum."""


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
    for f in weight_files(path):
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
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
