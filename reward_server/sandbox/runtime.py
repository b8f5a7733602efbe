"""The minimal file system a sandboxed Python needs, discovered from the interpreter.

Both gVisor and bubblewrap build their root from this list of read-only
binds: the interpreter binary, its standard library, the directories of the
shared libraries it and its extension modules link, and tandem's guest code.
Nothing else of the host is visible: no /etc, no /home, no /work, no
site-packages of the host's other Pythons. Paths keep their host location
so the interpreter finds its prefix without configuration.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from reward_server.sandbox.base import GUEST_MOUNT
from reward_server.sandbox.guest import GUEST_DIR

LDD_PATH = re.compile(r"(/\S+\.so[^\s]*)")
# Discovery runs with a clean environment: LD_PRELOAD / LD_LIBRARY_PATH of this process (vLLM
# sets LD_PRELOAD for its OpenMP and allocator libraries in the venv) would otherwise pull host
# directories such as the venv into the sandbox's root.
CLEAN_ENV = {"PATH": os.defpath}


@dataclass(frozen=True)
class RuntimeLayout:
    python: str
    """Real path of the interpreter (its path inside the sandbox too)."""
    binds: tuple[tuple[str, str], ...]
    """(host path, sandbox path) read-only binds, parents before children."""


def _shared_lib_dirs(paths: list[str]) -> set[str]:
    dirs: set[str] = set()
    for chunk in range(0, len(paths), 64):
        out = subprocess.run(
            ["ldd", *paths[chunk : chunk + 64]], capture_output=True, text=True, timeout=30, check=False,
            env=CLEAN_ENV,
        ).stdout
        for lib in LDD_PATH.findall(out):
            if os.path.exists(lib):
                dirs.add(os.path.dirname(lib))
                dirs.add(os.path.dirname(os.path.realpath(lib)))
    return dirs


@lru_cache(maxsize=4)
def discover(python: str = "/usr/bin/python3") -> RuntimeLayout:
    """Ask ``python`` where its pieces are; raise ``FileNotFoundError`` if it is unusable."""
    exe = os.path.realpath(python)
    if not os.access(exe, os.X_OK):
        raise FileNotFoundError(f"no Python interpreter at {python}")
    probe = (
        "import json,sys,sysconfig;"
        "p=sysconfig.get_paths();"
        "print(json.dumps([p['stdlib'],p['platstdlib'],sysconfig.get_config_var('DESTSHARED') or '']))"
    )
    stdlib, platstdlib, dynload = json.loads(
        subprocess.run(
            [exe, "-I", "-c", probe], capture_output=True, text=True, timeout=30, check=True, env=CLEAN_ENV
        ).stdout
    )
    trees = sorted({os.path.realpath(p) for p in (stdlib, platstdlib, dynload) if p and os.path.isdir(p)})
    # Drop trees nested in another one (lib-dynload inside the stdlib).
    trees = [t for t in trees if not any(t != o and t.startswith(o + os.sep) for o in trees)]
    extensions = [str(p) for t in trees for p in Path(t).rglob("*.so")]
    lib_dirs = _shared_lib_dirs([exe, *extensions])
    lib_dirs = {d for d in lib_dirs if not any(d.startswith(t + os.sep) or d == t for t in trees)}
    binds = [(exe, exe)] + [(t, t) for t in trees] + [(d, d) for d in sorted(lib_dirs)]
    binds.append((str(GUEST_DIR), GUEST_MOUNT))
    return RuntimeLayout(python=exe, binds=tuple(binds))
