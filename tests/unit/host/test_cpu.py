"""host.cpu: real processes that burn known CPU, counted once each, and kept after they end."""

from __future__ import annotations

import subprocess
import sys

from host.cpu import CpuMeter, read_stat
from host.processes import stop_group

BURN = "import time\ndef burn(s):\n    t = time.process_time()\n    while time.process_time() - t < s: pass\n"

# burns 0.3 s, starts a child that burns 0.5 s and says so, waits for a line, then reaps the child
PARENT = BURN + f"""
import subprocess, sys
burn(0.3)
child = subprocess.Popen([sys.executable, "-c", {BURN + 'burn(0.5); print("burnt", flush=True); input()'!r}],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
input()
child.communicate("\\n")
print("reaped", flush=True)
input()
"""


def test_a_reaped_child_is_counted_once_and_a_departed_process_keeps_its_reading():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        meter = CpuMeter()
        alive = meter.sample([parent.pid, child])  # both alive: each counts its own
        assert 0.75 <= sum(alive.values()) < 1.2, alive
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "reaped"
        reaped = meter.sample([parent.pid])  # the child is now in its parent's cutime, not twice
        assert read_stat(child) is None
        assert 0.75 <= sum(reaped.values()) < 1.2, reaped
        assert sum(reaped.values()) >= sum(alive.values()) - 0.01
        parent.stdin.write("\n")
        parent.stdin.flush()
        parent.wait(timeout=30)  # reaped by the test, outside the set: the meter keeps its last reading
        gone = meter.sample([])
        assert gone == reaped
    finally:
        stop_group(parent, grace_s=0)
