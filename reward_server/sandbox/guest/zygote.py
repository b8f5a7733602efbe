"""A clean, pre-initialised Python that forks one child per program run (gVisor serve mode).

Starting a Python interpreter inside gVisor costs ~90 ms of mostly system
calls; forking an initialised one costs ~30 ms. The agent forks this zygote
at start-up, *before it reads any job*, so the zygote's memory never holds
another submission's code or output. For each run the agent sends
``{"launcher", "args", "cwd", "uid", "env", "limits"}`` plus the child's
stdin/stdout/stderr (and results) pipe ends over a Unix socket; the zygote
forks, and the child enters a new IPC namespace (when the agent found that
possible), drops to the job's uid, applies the limits, takes the
pipes as fds 0-2 (3), closes everything else and runs the launcher
(``boot.py`` or ``harness.py``) in-process, exactly as ``python3 -I
launcher.py ARGS`` would. The zygote answers ``{"pid"}`` at once and
``{"status", "cpu"}`` when the child exits.
"""

import atexit
import io
import json
import os
import signal
import socket
import sys
import traceback

import boot
import harness

LAUNCHERS = {"boot.py": boot, "harness.py": harness}


def exit_code(e):
    """What CPython's own exit does with a SystemExit."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    try:
        sys.stderr.write(str(e.code) + "\n")
    except (OSError, ValueError):
        pass
    return 1


def child(req, fds, make_limiter, nproc_extra=0):
    """In the forked child: become the job's process, run the launcher, exit. Never returns."""
    code = 1
    try:
        os.setsid()
        # The job's IPC namespace and uid, default signal dispositions, then its limits.
        make_limiter(req["limits"], nproc_extra, req["uid"])()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has them
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        os.chdir(req["cwd"])
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(len(fds), 65536)
        os.environ.clear()
        os.environ.update(req["env"])
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                      encoding="utf-8", errors="strict")
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                                        encoding="utf-8", errors="strict")
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                                        encoding="utf-8", errors="backslashreplace",
                                                        line_buffering=True)
        launcher = LAUNCHERS[req["launcher"]]
        sys.argv = [launcher.__file__] + req["args"]
        sys.path[0] = req["cwd"]
        try:
            launcher.main()
            code = 0
        except SystemExit as e:
            code = exit_code(e)
        except BaseException:  # noqa: BLE001 - as the interpreter would: print it, exit 1
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def serve(sock, make_limiter):
    """The zygote's loop: one spawn request at a time."""
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 8)
        except OSError:
            os._exit(0)
        if not msg:
            os._exit(0)  # the agent is gone
        req = json.loads(msg)
        pid = os.fork()
        if pid == 0:
            sock.close()
            child(req, fds, make_limiter)
        for fd in fds:
            os.close(fd)
        sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status, rusage = os.wait4(pid, 0)
        sock.sendall(json.dumps({"status": status, "cpu": rusage.ru_utime + rusage.ru_stime}).encode() + b"\n")


class Zygote:
    """The agent's handle on its zygote."""

    def __init__(self, make_limiter):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.pid = os.fork()
        if self.pid == 0:
            ours.close()
            # Let go of the agent's protocol pipes: tandem must see EOF when the agent dies.
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)
            os.dup2(devnull, 1)
            os.close(devnull)
            serve(theirs, make_limiter)
        theirs.close()
        self.sock = ours
        self.buffer = b""

    def spawn(self, req, fds):
        socket.send_fds(self.sock, [json.dumps(req).encode()], fds)
        return self.read()["pid"]

    def read(self):
        while b"\n" not in self.buffer:
            data = self.sock.recv(65536)
            if not data:
                raise OSError("zygote exited")
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def ready(self):
        """True if a message is (at least partly) waiting."""
        return b"\n" in self.buffer
