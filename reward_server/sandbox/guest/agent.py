"""The in-sandbox supervisor: reads jobs, runs untrusted programs under limits, answers verdicts.

Talks to tandem over its own stdin/stdout with frames (4-byte big-endian
length, then JSON). A job is ``{"files": {path: text}, "runs": [{"argv",
"stdin", "results"}], "limits": {...}}``; the answer is ``{"runs": [...]}``
with one verdict per run (see :func:`run_one`).

Modes:

- ``--serve``: many jobs, one after the other (gVisor's long-lived sandbox).
  The agent is PID 1 and root *inside* the sandbox; every job gets a fresh
  uid, a fresh 0700 work dir, and after every run all processes but the
  agent are killed, so nothing of one submission survives into the next.
- ``--oneshot [BASE]``: one job in a work dir under BASE (default /tmp), then exit (bubblewrap: a fresh namespace per job;
  Modal: one exec per job, a fresh uid when root).
- ``--oneshot BASE --warm``: as ``--oneshot``, in a reused container this agent owns
  (Modal's pooled sandboxes): as root it first makes the shared writable
  places private, kills every process of any job uid and deletes what job
  uids left in them, and takes the job's uid from a counter kept under BASE,
  so no two jobs of one container share a uid.

Hardening every mode shares:

- the answer is ``{"accepted": true}`` as soon as the job's files are
  written, then the verdict frame. A sandbox that ends between the two was
  ended by the job (or the host, while the job ran): the backends tell that
  apart from an infrastructure failure (no ``accepted``) with it;
- what a run sends on its results pipe is capped like its output
  (``output_bytes``), and everything one answer carries (outputs and
  results of all runs) by ``ANSWER_BUDGET``; a line on the results pipe that
  is not a JSON object is dropped, never an agent error;
- the agent ignores every signal a job could send it (SIGINT, SIGTERM,
  SIGHUP, ...), and programs start with default dispositions again; as
  PID 1 (bubblewrap) the kernel also drops SIGKILL/SIGSTOP from the job;
- as root, each run starts in a new System V IPC namespace (shared memory,
  semaphores, message queues of one run are invisible to any other); where
  the kernel refuses that, the job uid's IPC objects are removed after it.

Stdlib only: this file runs on the sandbox's Python, not tandem's venv.
"""

import json
import os
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ANSWER_BUDGET = 64 << 20  # bytes of stdout+stderr+results one answer carries, all runs together
JOB_UIDS = 40000  # job uids are FIRST_UID .. FIRST_UID + JOB_UIDS - 1
CLONE_NEWIPC = 0x08000000
IGNORED_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM",
                                       "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGPIPE", "SIGVTALRM", "SIGPROF",
                                       "SIGXCPU", "SIGXFSZ", "SIGIO", "SIGPWR", "SIGWINCH", "SIGURG")
    if hasattr(signal, name))
SHARED_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run/lock", "/var/lock")
IPC_NS = {"private": None}  # whether runs get their own IPC namespace (probed once, as root)
HEADER = struct.Struct(">I")
MAX_FRAME = 512 << 20
COMPILE_ERROR_EXIT = 97  # boot.py / harness.py: the program does not compile
FIRST_UID = 20000
CHUNK = 65536
ZYGOTE = None  # serve mode: the clean pre-initialised Python that forks program runs


def read_frame(stream):
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None  # tandem closed the pipe: shut down
    (size,) = HEADER.unpack(head)
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes")
    body = stream.read(size)
    if len(body) < size:
        return None
    return json.loads(body)


def write_frame(stream, obj):
    body = json.dumps(obj).encode()
    stream.write(HEADER.pack(len(body)) + body)
    stream.flush()


def libc():
    import ctypes  # noqa: PLC0415 - only root modes need it

    return ctypes.CDLL(None, use_errno=True)


def private_ipc():
    """In a child about to become a job (as root): a new IPC namespace; False if the kernel refuses."""
    return libc().unshare(CLONE_NEWIPC) == 0


def probe_private_ipc():
    """Whether runs can get their own IPC namespace here (a throw-away child tries it)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if private_ipc() else 1)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def become(uid):
    """In the child, as root: a private IPC namespace (when the kernel allows), then the job's uid, no groups."""
    if IPC_NS["private"] and not private_ipc():
        os._exit(126)  # the probe said it works: refuse to run without it rather than share IPC
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def default_signals():
    """In the child: undo the agent's ignored signals (an ignored disposition survives exec)."""
    for sig in IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def make_limiter(limits, nproc_extra, uid=None):
    """Limits for the program; ``nproc_extra`` counts processes of the same uid that are not
    the program's (bubblewrap: its monitor and this agent share the slot's uid). With ``uid``
    (exec'd programs) the limiter also drops to it: Popen's own user= would run before it."""
    memory = int(limits["memory_mb"]) << 20
    cpu = max(1, int(limits["cpu_s"] + 0.999))

    def apply():
        # Runs in the child between fork and exec; only lowers limits.
        default_signals()
        if uid is not None:
            become(uid)
        try:  # the job, not the agent, is what the kernel's OOM killer should pick
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        nproc = int(limits["processes"]) + nproc_extra
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        size = int(limits["file_bytes"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def other_pids():
    """Every live process but this agent and PID 1 (zombies left to a PID 1 that is not ours are dead already)."""
    me = os.getpid()
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (me, 1) and not zombie(p)]


def zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True  # gone


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def sweep(uid):
    """Kill every process the last run left behind, and reap them."""
    for _ in range(200):
        if os.getpid() == 1 and ZYGOTE is not None and uid is not None:
            # kill(-1) would take the zygote too: kill the job uid's processes one by one.
            left = [p for p in other_pids() if owner(p) == uid]
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            reap()
            if not left:
                return True
            time.sleep(0.002)
            continue
        if os.getpid() == 1:
            # PID 1 of the sandbox's PID namespace: kill(-1) reaches every other process.
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        elif uid is not None:
            helper = os.fork()
            if helper == 0:  # a helper with the job's uid kills everything that uid owns
                try:
                    os.setgid(uid)
                    os.setuid(uid)
                    os.kill(-1, signal.SIGKILL)
                except OSError:
                    pass
                os._exit(0)
            os.waitpid(helper, 0)
        else:
            return True  # neither PID 1 nor root: the process-group kill is all there is
        reap()
        left = other_pids() if os.getpid() == 1 else [p for p in other_pids() if owner(p) == uid]
        if not left:
            return True
        time.sleep(0.005)
    return False


def owner(pid):
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def classify(code, sig, stderr, killed_for, cpu_s, limits):
    tail = stderr[-4000:]
    if killed_for == "output":
        return "output_limit", f"output over {limits['output_bytes']} bytes"
    if killed_for == "results":
        return "output_limit", "results over the output limit"
    if killed_for == "wall":
        return "timeout", "wall time over {:.1f} s".format(limits["wall_s"])
    if sig in (signal.SIGXCPU,) or (sig == signal.SIGKILL and cpu_s >= limits["cpu_s"] * 0.95):
        return "timeout", "cpu time over {:.1f} s".format(limits["cpu_s"])
    if sig == signal.SIGXFSZ or "File too large" in tail:
        return "output_limit", f"file over {limits['file_bytes']} bytes"
    if "MemoryError" in tail or "Cannot allocate memory" in tail or "memory allocation failed" in tail:
        return "memory_limit", f"address space over {limits['memory_mb']} MB"
    if code == COMPILE_ERROR_EXIT:
        return "compile_error", tail.strip().splitlines()[-1] if tail.strip() else ""
    if sig is not None:
        return "runtime_error", f"killed by signal {sig}"
    if code != 0:
        lines = tail.strip().splitlines()
        return "runtime_error", lines[-1] if lines else f"exit status {code}"
    return "ok", ""


class PopenChild:
    """A program started with fork+exec (any argv)."""

    notify_fd = None

    def __init__(self, argv, cwd, env, uid, limits, results_w):
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=cwd, env=env, start_new_session=True, close_fds=True,
            pass_fds=(results_w,) if results_w is not None else (),
            preexec_fn=make_limiter(limits, 0 if uid is not None else 2, uid),
        )
        self.pid = self.proc.pid
        self.stdin_fd, self.stdout_fd, self.stderr_fd = (
            self.proc.stdin.fileno(), self.proc.stdout.fileno(), self.proc.stderr.fileno())

    def poll(self):
        pid, status, ru = os.wait4(self.pid, os.WNOHANG)
        return (status, ru.ru_utime + ru.ru_stime) if pid else None

    def wait(self):
        _, status, ru = os.wait4(self.pid, 0)
        return status, ru.ru_utime + ru.ru_stime

    def close_stdin(self):
        if not self.proc.stdin.closed:
            self.proc.stdin.close()

    def close(self):
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if not f.closed:
                f.close()


class RawPipes:
    """stdin/stdout/stderr of a child held as raw pipe descriptors."""

    def open_pipes(self, results_w):
        """Make the three pipes; return the descriptors the child gets (the caller closes the first three)."""
        in_r, self.stdin_fd = os.pipe()
        self.stdout_fd, out_w = os.pipe()
        self.stderr_fd, err_w = os.pipe()
        self.stdin_open = True
        return [in_r, out_w, err_w] + ([results_w] if results_w is not None else [])

    def close_stdin(self):
        if self.stdin_open:
            os.close(self.stdin_fd)
            self.stdin_open = False

    def close(self):
        self.close_stdin()
        for fd in (self.stdout_fd, self.stderr_fd):
            os.close(fd)


class ZygoteChild(RawPipes):
    """A launcher run forked from the zygote (no exec, no interpreter start-up)."""

    def __init__(self, zygote, launcher, args, cwd, env, uid, limits, results_w):
        self.zygote = zygote
        fds = self.open_pipes(results_w)
        req = {"launcher": launcher, "args": args, "cwd": cwd, "env": env, "uid": uid, "limits": limits}
        try:
            self.pid = zygote.spawn(req, fds)
        finally:
            for fd in fds[:3]:
                os.close(fd)
        self.notify_fd = zygote.sock.fileno()

    def poll(self):
        if self.zygote.ready() or select.select([self.notify_fd], [], [], 0)[0]:
            return self.wait()
        return None

    def wait(self):
        msg = self.zygote.read()
        return msg["status"], msg["cpu"]


class ForkChild(RawPipes, PopenChild):
    """One-shot mode: the launcher forked straight from this agent, which holds this job only."""

    def __init__(self, launcher, args, cwd, env, uid, limits, results_w):
        from zygote import child  # noqa: PLC0415 - the launchers load only when a run needs them

        fds = self.open_pipes(results_w)
        req = {"launcher": launcher, "args": args, "cwd": cwd, "env": env, "uid": uid, "limits": limits}
        self.pid = os.fork()
        if self.pid == 0:
            child(req, fds, make_limiter, 0 if uid is not None else 2)
        for fd in fds[:3]:
            os.close(fd)


def launch(run, cwd, uid, env, limits, results_w):
    argv = [a.replace("{guest}", HERE) for a in run["argv"]]
    launcher = os.path.basename(argv[2]) if len(argv) > 2 and argv[1] == "-I" else None
    if launcher in ("boot.py", "harness.py") and os.path.dirname(argv[2]) == HERE:
        args = [a.replace("{results_fd}", "3") for a in argv[3:]]
        if ZYGOTE is not None:
            return ZygoteChild(ZYGOTE, launcher, args, cwd, env, uid, limits, results_w)
        return ForkChild(launcher, args, cwd, env, uid, limits, results_w)
    argv = [a.replace("{results_fd}", str(results_w)) for a in argv]
    return PopenChild(argv, cwd, env, uid, limits, results_w)


def parse_results(data):
    """The JSON objects among the results lines; anything else a program wrote there is dropped."""
    found = []
    for line in data.decode("utf-8", "replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict):
            found.append(obj)
    return found


def run_one(run, limits, cwd, uid, env, budget=ANSWER_BUDGET):
    """Run one program; return its verdict dict. ``budget``: bytes this run's answer may still carry."""
    results_r = results_w = None
    if run.get("results"):
        results_r, results_w = os.pipe()
    start = time.monotonic()
    try:
        child = launch(run, cwd, uid, env, limits, results_w)
    finally:
        if results_w is not None:
            os.close(results_w)
    stdin = run.get("stdin", "").encode()
    out_fd, err_fd = child.stdout_fd, child.stderr_fd
    out = {out_fd: bytearray(), err_fd: bytearray()}
    results = bytearray()
    readers = list(out) + ([results_r] if results_r is not None else [])
    writers = [child.stdin_fd] if stdin else []
    if not stdin:
        child.close_stdin()
    notify = [child.notify_fd] if child.notify_fd is not None else []
    cap = max(0, min(int(limits["output_bytes"]), budget))
    results_cap = max(0, min(int(limits["output_bytes"]), budget - cap))
    deadline = start + float(limits["wall_s"])
    killed_for = None
    exit_info = None
    exited_at = None
    written = 0
    while True:
        now = time.monotonic()
        if exit_info is None:
            exit_info = child.poll()
            if exit_info is not None:
                exited_at, notify = now, []
        if exited_at is not None and (not readers or now - exited_at > 0.1):
            break  # exited; a leftover background process may hold the pipes open
        if now >= deadline:
            killed_for = "wall"
            break
        r, w, _ = select.select(readers + notify, writers, [], min(0.02, deadline - now))
        for fd in w:
            try:
                written += os.write(fd, stdin[written:written + CHUNK])
            except (BrokenPipeError, BlockingIOError):
                written = len(stdin)  # the program closed its stdin: stop feeding it
            if written >= len(stdin):
                writers.remove(fd)
                child.close_stdin()
        for fd in r:
            if fd in notify:
                continue  # the exit notice: read by child.poll() at the top of the loop
            data = os.read(fd, CHUNK)
            if not data:
                readers.remove(fd)
            elif fd == results_r:
                results += data
            else:
                out[fd] += data
        if len(out[out_fd]) + len(out[err_fd]) > cap:
            killed_for = "output"
            break
        if len(results) > results_cap:
            killed_for = "results"
            break
    if exit_info is None:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        exit_info = child.wait()
    status, cpu = exit_info
    wall = time.monotonic() - start
    clean = sweep(uid)
    for fd in readers:  # whatever is still buffered (the writers are dead now)
        sink = results if fd == results_r else out[fd]
        while len(sink) <= (results_cap if fd == results_r else cap) and select.select([fd], [], [], 0)[0]:
            data = os.read(fd, CHUNK)
            if not data:
                break
            sink += data
    child.close()
    if results_r is not None:
        os.close(results_r)
    stdout, stderr = bytes(out[out_fd]), bytes(out[err_fd])
    truncated = len(stdout) + len(stderr) > cap
    stdout, stderr = stdout[:cap], stderr[: max(0, cap - len(stdout))]
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    err = stderr.decode("utf-8", "replace")
    verdict, detail = classify(code, sig, err, killed_for, cpu, limits)
    return {
        "status": verdict, "detail": detail, "exit_code": code if code is not None else -(sig or 0),
        "stdout": stdout.decode("utf-8", "replace"), "stderr": err,
        "wall_s": round(wall, 4), "cpu_s": round(cpu, 4), "truncated": truncated,
        "results": parse_results(bytes(results[:results_cap])) if results_r is not None else None,
        "clean": clean,
    }


def safe_path(root, rel):
    path = os.path.normpath(os.path.join(root, rel))
    if os.path.isabs(rel) or not path.startswith(root + os.sep):
        raise ValueError(f"file path escapes the work dir: {rel!r}")
    return path


def run_job(job, serial, base, accept):
    """Write the job's files, call ``accept()``, run its programs; the answer. Work dir removed after."""
    root = os.geteuid() == 0
    uid = FIRST_UID + serial % JOB_UIDS if root else None
    cwd = os.path.join(base, f"job{serial}")
    os.makedirs(cwd, mode=0o700)
    try:
        for rel, text in job.get("files", {}).items():
            path = safe_path(cwd, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        if root:
            for d, dirs, files in os.walk(cwd):
                for name in [d] + [os.path.join(d, x) for x in dirs + files]:
                    os.chown(name, uid, uid)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
        accept()
        runs, budget = [], ANSWER_BUDGET
        for r in job["runs"]:
            runs.append(run_one(r, job["limits"], cwd, uid, env, budget))
            budget -= len(runs[-1]["stdout"]) + len(runs[-1]["stderr"]) + len(json.dumps(runs[-1]["results"]))
        return {"runs": runs}
    finally:
        shutil.rmtree(cwd, ignore_errors=True)  # rmtree does not follow the program's symlinks
        if root and not IPC_NS["private"]:
            remove_ipc(uid)


def job_uid(uid):
    return uid is not None and FIRST_UID <= uid < FIRST_UID + JOB_UIDS


def remove_ipc(uid=None):
    """Without private IPC namespaces: delete the System V objects of ``uid`` (None: of every job uid)."""
    lib = None
    for kind, column in (("shm", 7), ("sem", 4), ("msg", 7)):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        for row in rows:
            owner_uid = int(row[column]) if len(row) > column else None
            if (owner_uid == uid) if uid is not None else job_uid(owner_uid):
                lib = lib or libc()
                ident = int(row[1])
                if kind == "shm":
                    lib.shmctl(ident, 0, None)  # IPC_RMID = 0
                elif kind == "sem":
                    lib.semctl(ident, 0, 0)
                else:
                    lib.msgctl(ident, 0, None)


def harden(base="/tmp/jobs"):
    """Make the sandbox's shared writable places private to the agent (root in a sandbox it owns)."""
    if os.geteuid() != 0:
        return
    os.makedirs(base, mode=0o711, exist_ok=True)
    for path in (base, *SHARED_DIRS):
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o711 if path in (base, "/tmp") else 0o700)


def clean_leftovers(base):
    """Warm mode, before a job: no process, file or IPC object of any earlier job survives."""
    for _ in range(100):
        left = [p for p in other_pids() if job_uid(owner(p))]
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not left:
            break
        time.sleep(0.005)
    for d in (base, *SHARED_DIRS):
        try:
            entries = os.listdir(d)
        except OSError:
            continue
        for name in entries:
            path = os.path.join(d, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if job_uid(st.st_uid) or (d == base and name.startswith("job")):
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
    remove_ipc()


def next_serial(base):
    """Warm mode: a per-container job counter kept in a root-only file under ``base``."""
    path = os.path.join(base, ".tandem-serial")
    try:
        with open(path) as f:
            serial = int(f.read() or 0) + 1
    except (OSError, ValueError):
        serial = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(str(serial))
    return serial


def ignore_signals():
    """Nothing a job can send stops the agent (SIGKILL/SIGSTOP: see the module docstring)."""
    for sig in IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def no_dumping():
    # Programs of the agent's own uid (bubblewrap) must not ptrace it or read its fds.
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except (ImportError, OSError, AttributeError):
        pass


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "--oneshot"
    sys.path.insert(0, HERE)  # -I leaves the script's directory off sys.path: the launchers live here
    base = sys.argv[2] if len(sys.argv) > 2 and not sys.argv[2].startswith("--") else "/tmp"
    warm = "--warm" in sys.argv
    no_dumping()
    ignore_signals()
    if os.geteuid() == 0:
        IPC_NS["private"] = probe_private_ipc()
    if mode == "--serve":
        base = "/tmp/jobs"
        harden(base)
        if os.getpid() == 1 and os.geteuid() == 0 and "--no-zygote" not in sys.argv:
            global ZYGOTE
            from zygote import Zygote  # noqa: PLC0415 - only serve mode forks one, before any job

            ZYGOTE = Zygote(make_limiter)
    elif warm and os.geteuid() == 0:
        harden(base)
        clean_leftovers(base)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    # --serve: a random start, so two sandboxes of one pool do not hand out the same uids and work dirs
    serial = int(time.time() * 1000) % 100000 if mode == "--oneshot" else int.from_bytes(os.urandom(4)) % JOB_UIDS
    if warm and os.geteuid() == 0:
        serial = next_serial(base)
    while True:
        job = read_frame(stdin)
        if job is None:
            return
        try:
            answer = run_job(job, serial, base, lambda: write_frame(stdout, {"accepted": True}))
        except (OSError, ValueError, KeyError, subprocess.SubprocessError) as e:
            answer = {"error": f"{type(e).__name__}: {e}"}
        write_frame(stdout, answer)
        serial += 1
        if mode == "--oneshot":
            if warm and os.geteuid() == 0:
                clean_leftovers(base)
            return


if __name__ == "__main__":
    main()
