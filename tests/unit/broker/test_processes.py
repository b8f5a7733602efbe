"""broker.processes: finding what a dead process started, whatever group or session it moved to."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from broker.processes import OWNER_VARIABLE, group_members, kill_owned, owned_by

# a parent that starts a grandchild in a session of its own (as torchrun starts its ranks), prints its pid, waits
SCRIPT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(60)
"""


def test_an_orphan_in_another_session_is_found_by_its_owner_tag_and_killed():
    tag = f"test-{os.getpid()}-{time.monotonic_ns()}"
    parent = subprocess.Popen([sys.executable, "-c", SCRIPT], env={**os.environ, OWNER_VARIABLE: f"{tag}/learner"},
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    orphan = int(parent.stdout.readline())
    try:
        assert set(owned_by(f"{tag}/learner")) == {parent.pid, orphan}
        assert set(owned_by(tag)) == {parent.pid, orphan}  # the stack's tag covers its children's
        assert owned_by(f"{tag}/rollout") == [] and owned_by(tag + "x") == []
        parent.kill()
        parent.wait()
        assert group_members(parent.pid) == []  # the orphan is not in the dead parent's group
        assert owned_by(f"{tag}/learner") == [orphan]
        assert kill_owned(f"{tag}/learner") == 1
        assert owned_by(tag) == []
    finally:
        for pid in (parent.pid, orphan):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
