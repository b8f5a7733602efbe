"""Files replaced whole: a reader sees the old content or the new, never a part.

:func:`write_atomic` is the one way tandem replaces a file that another process (or the same
one, after a crash) reads back: the learner's checkpoint state and pointer, its config and
retention record in the run directory, the trajectory ledger's export, the local stack's
``stack.json``. It writes a temporary file beside the target (a dot name unique to the writer,
created exclusively and never through a symbolic link, with the permissions asked for: ``0o600``
for a file that holds a secret, from its first byte), fsyncs it and renames it over the target;
``rename`` within one directory is atomic on POSIX file systems. A writer that fails part way
removes its temporary file.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomic(path: str | Path, data: str | bytes, mode: int = 0o666) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8), atomically and durably.

    ``mode`` is the new file's permissions before the umask (as ``open``'s, whatever mode an
    older file had)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
