"""Code that runs *inside* a sandbox: stdlib only, Python 3.8+, no tandem imports.

``agent.py`` is the in-sandbox supervisor (jobs in, verdicts out, over
stdin/stdout frames); ``boot.py`` and ``harness.py`` are the launchers it
starts untrusted programs with; ``zygote.py`` forks them from a clean,
pre-initialised interpreter in gVisor's long-lived sandboxes. The directory is mounted read-only into
gVisor and bubblewrap sandboxes and copied into Modal images.
"""

from pathlib import Path

GUEST_DIR = Path(__file__).parent
