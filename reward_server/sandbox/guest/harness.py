"""Assert-style tests against a program, with verdicts the program cannot write, fake or see.

Usage: ``python3 -I harness.py SOLUTION.py WALL_S RESULTS_FD``, the tests (a
JSON list of Python sources) on stdin. After every test one line ``{"i": N,
"ok": bool, "status": S, "error": str}`` goes to RESULTS_FD at once, so the
verdicts reached before a kill survive it; S is ``ok``, ``wrong_answer``,
``runtime_error``, ``timeout`` or ``memory_limit``.

Two processes, and only one of them is trusted:

- the *program process* runs SOLUTION.py as module ``solution`` and then
  serves requests on two pipes of its own: "call this function of yours with
  these arguments", "give me this attribute", "iterate this object". It is
  forked before the tests are read (a respawn after a crash is a fresh
  ``python3 -I harness.py --worker``), in its own process group, with stdin
  on /dev/null, a fixed environment and no other descriptor: not the
  results pipe, not the tests on stdin.
- the *harness* never imports or runs the program. It makes itself
  non-dumpable (so a process of the same uid can neither ptrace it nor open
  its ``/proc/PID/mem`` or ``/proc/PID/fd``), reads the tests, and executes
  each test in its own interpreter, where every name the test uses but does
  not define (and is neither a builtin nor a standard module it reaches into)
  stands for the program's object of that name. Calls go to the program;
  what comes back is decoded into exact builtin types (None, bool, int,
  float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset,
  and collections' OrderedDict, Counter, deque; a defaultdict arrives as a
  dict) built by the harness itself, size- and depth-capped; anything else
  stays in the program as an opaque handle that can be called, read,
  iterated, sized and tested for truth, but never compared, hashed or used in
  arithmetic. So ``==``, ``in``, ``not`` and every other operation of a test
  run on values the harness made, in code the harness owns, and the verdict
  is the harness's: the test ran to the end without an exception and the
  program never failed during it. Arguments are sent by value (a list, dict
  or set argument is copied back after the call, so in-place functions work);
  the test source and the expected values never leave the harness.

Hacks this closes (each is a case of tests/integration/reward_server/test_hacks.py):
writing verdict lines to any inherited descriptor, or to the parent's through
``/proc``; ``os._exit(0)``, ``sys.exit``, ``SystemExit``/``KeyboardInterrupt``
from the function under test, atexit hooks, killing or stopping the harness;
objects whose ``__eq__`` is always true, int/str/list subclasses with rigged
comparisons; patching ``json``, ``builtins``, ``unittest``, ``sys.excepthook``
or ``sys.settrace``; defining names the tests use for their own helpers or for
builtins (``check``, ``candidate``, ``len``, ``isinstance``) or modules they
forgot to import (``math``); reading the tests from disk, from the harness's
memory, from the call stack or ``gc``; raising ``StopIteration`` to end a test's
loop early; printing fake results to stdout/stderr; forking processes that
outlive their test (the process group is killed after the run or a failure).

Residual risks: the program sees its call arguments (inputs shown in the
prompt can be hard-coded: no harness stops that); within one test it learns
that a call passed when the next one arrives, and it can keep notes in its
work dir; it can kill or stop the harness (the remaining tests fail, never
pass). Refused rather than forged: passing the test's own functions, lambdas
or classes to the program; comparing the program's objects (return plain
data); Fraction/Decimal/numpy results; coroutines. One program process
serves all tests (state carries over, as before) until it crashes; the next
test gets a fresh one. A program name that shadows a builtin is not used
(tests reach it as ``solution.NAME``), and a non-standard module a test uses
without importing it is the program's. Cost under gVisor: ~40-60 ms per job
(the fork and start-up handshake) and ~0.3 ms per call.

Stdlib only, Python 3.8+: this file runs on the sandbox's Python.
"""

import ast
import builtins
import collections
import ctypes
import itertools
import json
import os
import select
import signal
import struct
import subprocess
import sys
import time
import traceback
import types

COMPILE_ERROR_EXIT = 97
HEADER = struct.Struct(">I")
MAX_REPLY = 8 << 20  # bytes of one answer of the program
MAX_DEPTH = 64  # nesting of one value
MAX_ITEMS = 1 << 20  # items of one iteration
BIG = 1 << 63  # ints beyond travel as hex: decimal conversion is capped at 4300 digits
HERE = os.path.abspath(__file__)
PR_SET_PDEATHSIG, PR_GET_DUMPABLE, PR_SET_DUMPABLE = 1, 3, 4
PROGRAM_ENV = ("PATH", "HOME", "TMPDIR", "LANG", "PYTHONIOENCODING", "PYTHONDONTWRITEBYTECODE")
STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) | {"math", "re", "collections", "itertools", "string"}
# Exceptions of the program a test may catch, rebuilt by type name; StopIteration would end a test's loop early.
RAISABLE = {name: cls for name, cls in vars(builtins).items()
            if isinstance(cls, type) and issubclass(cls, Exception) and cls not in (StopIteration, StopAsyncIteration)}


# --- values: one codec for both directions ----------------------------------------------------------

class NotPlain(Exception):
    """A value that is not plain data (an object, a subclass of a builtin, too deep)."""


def _refuse(value):
    raise NotPlain(type(value).__name__)


def encode(value, other=_refuse, depth=0):
    """``value`` as JSON-able data that keeps exact types; ``other(obj)`` encodes what is not plain data."""
    t = type(value)
    if value is None or t is bool or t is float or t is str:
        return value
    if t is int:
        return value if -BIG < value < BIG else {"x": hex(value)}
    if depth < MAX_DEPTH:
        down = depth + 1
        if t is list:
            return [encode(v, other, down) for v in value]
        if t is tuple or t is collections.deque:
            return {"t" if t is tuple else "q": [encode(v, other, down) for v in value]}
        if t in PAIR_TAGS:
            try:
                pairs = [(encode(k, _refuse, down), v) for k, v in value.items()]
            except NotPlain:
                return other(value)
            return {PAIR_TAGS[t]: [[k, encode(v, other, down)] for k, v in pairs]}
        if t is set or t is frozenset:
            try:
                return {"s" if t is set else "f": [encode(v, _refuse, down) for v in value]}
            except NotPlain:
                return other(value)
        if t is bytes or t is bytearray:
            return {"b" if t is bytes else "B": value.hex()}
        if t is complex:
            return {"c": [value.real, value.imag]}
        if t is slice:
            return {"S": [encode(x, _refuse, down) for x in (value.start, value.stop, value.step)]}
    return other(value)


PAIR_TAGS = {dict: "d", collections.OrderedDict: "o", collections.Counter: "C", collections.defaultdict: "d"}
PAIR_TYPES = {"d": dict, "o": collections.OrderedDict, "C": collections.Counter}
SEQ_TYPES = {"t": tuple, "q": collections.deque, "s": set, "f": frozenset}


def decode(data, special, depth=0):
    """Data from :func:`encode` -> a value of exact builtin types; ValueError/TypeError if it is not such data.

    ``special(tag, body)`` builds the references (``h``: a handle of the program, ``r``: an object the
    harness passed back)."""
    t = type(data)
    if data is None or t is bool or t is int or t is float or t is str:
        return data
    if depth > MAX_DEPTH + 1:
        raise ValueError("value nested too deeply")
    down = depth + 1
    if t is list:
        return [decode(x, special, down) for x in data]
    if t is not dict or len(data) != 1:
        raise ValueError("not an encoded value")
    ((tag, body),) = data.items()
    if tag in SEQ_TYPES and type(body) is list:
        return SEQ_TYPES[tag](decode(x, special, down) for x in body)
    if tag in PAIR_TYPES and type(body) is list:
        out = PAIR_TYPES[tag]()
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("not a key-value pair")
            out[decode(pair[0], special, down)] = decode(pair[1], special, down)
        return out
    if tag == "x" and type(body) is str:  # hex: linear to parse, and the answer's size is capped
        return int(body, 16)
    if tag in ("b", "B") and type(body) is str:
        return (bytes if tag == "b" else bytearray).fromhex(body)
    if tag == "c" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
        return complex(body[0], body[1])
    if tag == "S" and type(body) is list and len(body) == 3 and all(x is None or type(x) is int for x in body):
        return slice(*body)
    if tag in ("h", "r"):
        return special(tag, body)
    raise ValueError(f"unknown tag {tag!r}")


def write_frame(fd, obj):
    data = json.dumps(obj).encode()
    data = HEADER.pack(len(data)) + data
    while data:
        data = data[os.write(fd, data):]


class Frames:
    """Frames from a blocking descriptor (the program's end of the request pipe)."""

    def __init__(self, fd):
        self.fd, self.buf = fd, b""

    def read(self):
        """The next frame's JSON, or None at EOF."""
        head = self._take(HEADER.size)
        body = self._take(HEADER.unpack(head)[0]) if head is not None else None
        return json.loads(body) if body is not None else None

    def _take(self, n):
        while len(self.buf) < n:
            chunk = os.read(self.fd, max(n - len(self.buf), 1 << 16))
            if not chunk:
                return None
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


# --- the program process (untrusted: the completion's code runs here) --------------------------------

def serve(solution_path, req_fd, resp_fd):
    """Run the solution as module ``solution``, then answer the harness's requests until EOF."""
    module = types.ModuleType("solution")
    module.__file__ = solution_path
    sys.modules["solution"] = module
    sys.argv = [solution_path]
    try:
        with open(solution_path, encoding="utf-8", errors="replace") as f:
            exec(compile(f.read(), solution_path, "exec"), module.__dict__)
    except BaseException as e:  # noqa: BLE001 - any failure at import is the program's, told to the harness
        traceback.print_exc()
        sys.stderr.flush()
        write_frame(resp_fd, _failure(e))
        return
    write_frame(resp_fd, {"ready": True})
    objects, ids = [], {}

    def handle(obj):
        if id(obj) not in ids:
            ids[id(obj)] = len(objects)
            objects.append(obj)
        return {"h": [ids[id(obj)], type(obj).__name__[:100]]}

    def resolve(ref):
        kind = ref[0]
        if kind == "m":
            return module
        if kind == "h":
            return objects[ref[1]]
        if kind == "a":
            return getattr(resolve(ref[1]), ref[2])
        try:
            return module.__dict__[ref[1]]
        except KeyError:
            raise NameError(f"name {ref[1]!r} is not defined") from None

    def value(data):
        return decode(data, lambda tag, body: resolve(body))

    requests = Frames(req_fd)
    while True:
        msg = requests.read()
        if msg is None:
            return
        try:
            answer = _answer(msg, resolve(msg["ref"]), value, handle)
        except BaseException as e:  # noqa: BLE001 - reported to the harness, which decides
            answer = _failure(e)
        sys.stdout.flush()
        write_frame(resp_fd, answer)


def _answer(msg, obj, value, handle):
    op = msg["op"]
    if op == "call":
        args = [value(a) for a in msg["args"]]
        result = obj(*args, **{k: value(v) for k, v in msg["kwargs"]})
        return {"ok": encode(result, handle), "back": [encode(args[i], handle) for i in msg["back"]]}
    if op == "set":
        setattr(obj, msg["name"], value(msg["value"]))
        result = None
    elif op == "getitem":
        result = obj[value(msg["key"])]
    elif op == "setitem":
        obj[value(msg["key"])] = value(msg["value"])
        result = None
    elif op == "iter":
        result = list(itertools.islice(iter(obj), MAX_ITEMS + 1))
        if len(result) > MAX_ITEMS:
            raise ValueError(f"more than {MAX_ITEMS} items")
    else:
        result = {"get": lambda: obj, "len": lambda: len(obj), "bool": lambda: bool(obj), "str": lambda: str(obj)}[op]()
    return {"ok": encode(result, handle)}


def _failure(e):
    try:
        text = str(e)[:300]
    except Exception:  # noqa: BLE001 - a program's exception whose __str__ fails
        text = ""
    if isinstance(e, Exception):
        base = next((c.__name__ for c in type(e).__mro__ if c.__module__ == "builtins"), "Exception")
        return {"raise": [base, text]}
    return {"exit": f"{type(e).__name__}: {text}"}


# --- the harness (trusted: never runs the program's code) -------------------------------------------

class Abort(BaseException):
    """The program failed (exited, timed out, answered garbage): the current test fails whatever it catches."""

    def __init__(self, status, detail):
        super().__init__(f"{status}: {detail}")
        self.status, self.detail = status, detail


class Program:
    """The harness's end of the program process: requests out, plain values back, within the deadline."""

    def __init__(self, solution, deadline, wall_s):
        self.solution, self.deadline, self.wall_s = solution, deadline, wall_s
        self.generation, self.pid, self.reaped, self.ready, self.failure = 0, None, False, False, None

    def spawn(self, fork):
        """Start the program process: forked (before the tests are read), or a fresh interpreter."""
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        env = {k: os.environ[k] for k in PROGRAM_ENV if k in os.environ}
        parent = os.getpid()
        if fork:
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    _become_program(parent, (req_r, resp_w))
                    os.environ.clear()
                    os.environ.update(env)
                    serve(self.solution, req_r, resp_w)
                    code = 0
                finally:
                    os._exit(code)
        else:
            pid = subprocess.Popen(
                [sys.executable, "-I", HERE, "--worker", self.solution, str(req_r), str(resp_w)],
                stdin=subprocess.DEVNULL, close_fds=True, pass_fds=(req_r, resp_w), env=env,
                preexec_fn=lambda: _become_program(parent, None),
            ).pid
        os.close(req_r)
        os.close(resp_w)
        os.set_blocking(req_w, False)
        self.pid, self.req, self.resp, self.reaped, self.ready, self.inbox = pid, req_w, resp_r, False, False, b""
        self.generation += 1

    def start(self):
        """Wait until the program has run its top level; Abort if it failed there."""
        try:
            reply = self._receive()
        except Abort:
            self.kill()
            raise
        if reply != {"ready": True}:
            self.kill()
            failed = _raised(reply)
            if failed is not None:
                status = "memory_limit" if failed[0] == "MemoryError" else "runtime_error"
                raise Abort(status, f"{failed[0]}: {failed[1]} at start-up")
            raise Abort("runtime_error", f"the program {_exited(reply)} at start-up")
        self.ready = True

    def ask(self, msg):
        """One request -> its decoded value; the program's exception is raised again here."""
        return self.value(self.exchange(msg)["ok"])

    def call(self, ref, generation, args, kwargs):
        self.check(generation)
        back = [i for i, a in enumerate(args) if type(a) in (list, dict, set, bytearray)]
        reply = self.exchange({"op": "call", "ref": ref, "args": [encode(a, self.ref) for a in args],
                               "kwargs": [[k, encode(v, self.ref)] for k, v in kwargs.items()], "back": back})
        result, copies = self.value(reply["ok"]), reply.get("back")
        if type(copies) is not list or len(copies) != len(back):
            self.fail(Abort("runtime_error", "the program gave a malformed answer"))
        for n, i in enumerate(back):  # in-place changes to list/dict/set arguments, as a local call makes them
            new, old = self.value(copies[n]), args[i]
            if type(new) is type(old):
                if type(old) in (list, bytearray):
                    old[:] = new
                else:
                    old.clear()
                    old.update(new)
        return result

    def exchange(self, msg):
        if self.pid is None:  # it already failed in this test
            raise self.failure or Abort("runtime_error", "the program is not running")
        try:
            self._send(msg)
            reply = self._receive()
        except Abort as e:
            self.fail(e)
        if type(reply) is dict and "ok" in reply and set(reply) <= {"ok", "back"}:
            return reply
        failed = _raised(reply)
        if failed is None:
            self.fail(Abort("runtime_error", f"the program {_exited(reply)} during the test"))
        try:
            exc = RAISABLE.get(failed[0], RuntimeError)(failed[1])
        except Exception:  # noqa: BLE001 - exception types that take other arguments
            exc = RuntimeError(failed[1])
        raise exc

    def fail(self, abort):
        self.failure = abort
        self.kill()
        raise abort

    def value(self, data):
        try:
            return decode(data, self._handle)
        except (ValueError, TypeError, RecursionError, MemoryError) as e:
            self.fail(Abort("runtime_error", f"the program gave a malformed value ({type(e).__name__})"))

    def _handle(self, tag, body):
        if tag != "h" or type(body) is not list or len(body) != 2 or type(body[0]) is not int or type(body[1]) is not str:
            raise ValueError("not a handle")
        return Remote(self, ["h", body[0]], self.generation, body[1][:100])

    def ref(self, obj):
        """How an argument that is not plain data travels: only as a reference to the program's own object."""
        if type(obj) is not Remote:
            raise TypeError(f"a test can pass the program plain data and its own objects, not a {type(obj).__name__}")
        self.check(obj._generation)
        return {"r": obj._ref}

    def check(self, generation):
        if generation not in (None, self.generation):
            raise RuntimeError("an object of an earlier run of the program, which has crashed since")

    def kill(self):
        """Kill the program process and its group (forked children included), close its pipes."""
        if self.pid is None:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except OSError:
            pass
        if not self.reaped:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except OSError:
                pass
        os.close(self.req)
        os.close(self.resp)
        self.pid = None

    def _send(self, msg):
        data = json.dumps(msg).encode()
        data = HEADER.pack(len(data)) + data
        while data:
            try:
                data = data[os.write(self.req, data):]
            except BlockingIOError:
                self._wait(self.req, write=True)
            except BrokenPipeError:
                raise Abort(*(self._ended(0.1) or ("runtime_error", "the program closed its pipe"))) from None

    def _receive(self):
        (size,) = HEADER.unpack(self._read(HEADER.size))
        if size > MAX_REPLY:
            raise Abort("runtime_error", f"the program answered {size} bytes (over {MAX_REPLY})")
        try:
            return json.loads(self._read(size))
        except (ValueError, RecursionError, MemoryError):
            raise Abort("runtime_error", "the program gave a malformed answer") from None

    def _read(self, n):
        while len(self.inbox) < n:
            self._wait(self.resp, write=False)
            chunk = os.read(self.resp, min(max(n - len(self.inbox), 1 << 16), MAX_REPLY))
            if not chunk:
                raise Abort(*(self._ended(0.1) or ("runtime_error", "the program closed its pipe")))
            self.inbox += chunk
        out, self.inbox = self.inbox[:n], self.inbox[n:]
        return out

    def _wait(self, fd, write):
        """Until ``fd`` is ready; Abort at the deadline, or when the program died (a child may hold its pipes)."""
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise Abort("timeout", f"wall time over {self.wall_s:.1f} s")
            step = min(left, 0.05)
            if (select.select([], [fd], [], step) if write else select.select([fd], [], [], step)) != ([], [], []):
                return
            ended = self._ended(0)
            if ended:
                raise Abort(*ended)

    def _ended(self, grace):
        """(status, detail) if the program process has ended (waiting up to ``grace`` s), else None."""
        until = time.monotonic() + grace
        while not self.reaped:
            pid, status, usage = os.wait4(self.pid, os.WNOHANG)
            if pid:
                self.reaped = True
                break
            if time.monotonic() >= until:
                return None
            time.sleep(0.005)
        else:
            return None
        if os.WIFSIGNALED(status):
            sig, cpu, limit = os.WTERMSIG(status), usage.ru_utime + usage.ru_stime, _cpu_limit()
            if sig == signal.SIGXCPU or (limit is not None and cpu >= 0.95 * limit):
                return "timeout", f"cpu time over {limit} s"
            return "runtime_error", f"the program was killed by signal {sig} during the test"
        return "runtime_error", f"the program exited with status {os.WEXITSTATUS(status)} during the test"


def _raised(reply):
    """(builtin exception name, text) if ``reply`` reports the program's exception, else None."""
    if type(reply) is dict and len(reply) == 1 and type(reply.get("raise")) is list and len(reply["raise"]) == 2:
        name, text = reply["raise"]
        if type(name) is str and type(text) is str:
            return name, text
    return None


def _exited(reply):
    if type(reply) is dict and len(reply) == 1 and type(reply.get("exit")) is str:
        return f"exited ({reply['exit'][:200]})"
    return "gave a malformed answer"


def _cpu_limit():
    import resource  # noqa: PLC0415 - needed only once a program has died

    soft = resource.getrlimit(resource.RLIMIT_CPU)[0]
    return soft if soft != resource.RLIM_INFINITY else None


def _become_program(parent, keep):
    """First steps of the program process, before any of its code: its own process group, killed with
    the harness; when forked, stdin on /dev/null and every descriptor but ``keep`` and stdout/stderr closed."""
    os.setpgid(0, 0)
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)
    if keep is not None:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        last = 2
        for fd in sorted(keep):
            os.closerange(last + 1, fd)
            last = fd
        os.closerange(last + 1, 1 << 16)


class Remote:
    """An object of the program as a test sees it.

    A *root* (``generation`` None) is a name the test uses but does not define, looked up in the
    program at each use; a *handle* is an object the program gave back that is not plain data. Calls,
    attribute reads and writes, items, ``len``, iteration, truth and ``str`` are asked of the program
    and answered with plain data or handles. Comparison, hashing, arithmetic and ``in`` run here, on a
    root's plain value only: a handle refuses them, so the program's ``__eq__`` is never consulted."""

    __slots__ = ("_program", "_ref", "_generation", "_type")

    def __init__(self, program, ref, generation=None, type_name=""):
        for name, value in (("_program", program), ("_ref", ref), ("_generation", generation), ("_type", type_name)):
            object.__setattr__(self, name, value)

    def _now(self):
        """What this stands for now: plain data, or a handle."""
        self._program.check(self._generation)
        if self._generation is not None:
            return self
        return self._program.ask({"op": "get", "ref": self._ref})

    def _plain(self):
        value = self._now()
        if type(value) is Remote:
            raise TypeError(f"the program gave a {value._type} object where the test needs plain data "
                            "(None, bool, int, float, str, bytes, list, tuple, dict, set)")
        return value

    def _ask(self, op, check_type, local, **fields):
        value = self._now()
        if type(value) is not Remote:
            return local(value)
        fields = {k: encode(v, self._program.ref) for k, v in fields.items()}
        answer = self._program.ask({"op": op, "ref": value._ref, **fields})
        if check_type is not None and type(answer) is not check_type:
            raise TypeError(f"the program's {op} gave a {type(answer).__name__}, not a {check_type.__name__}")
        return answer

    def __call__(self, *args, **kwargs):
        return self._program.call(self._ref, self._generation, args, kwargs)

    def __getattr__(self, name):
        if name[:2] == "__" == name[-2:]:
            raise AttributeError(name)
        self._program.check(self._generation)
        return self._program.ask({"op": "get", "ref": ["a", self._ref, name]})

    def __setattr__(self, name, value):
        self._program.check(self._generation)
        self._program.ask({"op": "set", "ref": self._ref, "name": name, "value": encode(value, self._program.ref)})

    def __setitem__(self, key, value):
        self._program.check(self._generation)
        self._program.ask({"op": "setitem", "ref": self._ref, "key": encode(key, self._program.ref),
                           "value": encode(value, self._program.ref)})

    def __getitem__(self, key):
        return self._ask("getitem", None, lambda v: v[key], key=key)

    def __len__(self):
        return self._ask("len", int, len)

    def __iter__(self):
        return iter(self._ask("iter", list, lambda v: v))

    def __contains__(self, item):
        return item in self._ask("iter", list, lambda v: v)

    def __bool__(self):
        return self._ask("bool", bool, bool)

    def __str__(self):
        return self._ask("str", str, str)

    def __repr__(self):
        if self._generation is not None:
            return f"<the program's {self._type} object>"
        return "solution" if self._ref == ["m"] else f"solution.{self._ref[1]}"

    def __format__(self, spec):
        return format(self._plain(), spec) if spec else str(self)

    def __hash__(self):
        return hash(self._plain())


def _on_plain(fn, reflected=False):
    def method(self, *other):
        others = [o._plain() if type(o) is Remote else o for o in other]
        return fn(*others, self._plain()) if reflected else fn(self._plain(), *others)

    return method


for _name in ("eq", "ne", "lt", "le", "gt", "ge", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow",
              "and", "or", "xor", "lshift", "rshift", "matmul", "neg", "pos", "abs", "invert", "index"):
    _fn = getattr(__import__("operator"), f"__{_name}__")
    setattr(Remote, f"__{_name}__", _on_plain(_fn))
    if _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift", "matmul"):
        setattr(Remote, f"__r{_name}__", _on_plain(_fn, reflected=True))
for _name, _fn in (("int", int), ("float", float), ("complex", complex), ("round", round), ("divmod", divmod)):
    setattr(Remote, f"__{_name}__", _on_plain(_fn))


def free_names(tree):
    """{name: used only as ``name.attr``} for the names a test reads but never binds."""
    bases = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    bound, loads = set(), {}
    binders = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                loads[node.id] = loads.get(node.id, True) and id(node) in bases
            else:
                bound.add(node.id)
        elif isinstance(node, binders):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias) and node.name != "*":
            bound.add((node.asname or node.name).partition(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif type(node).__name__ in ("MatchAs", "MatchStar", "MatchMapping"):
            bound.add(getattr(node, "name", None) or getattr(node, "rest", None))
    return {name: attr_only for name, attr_only in loads.items() if name not in bound}


def test_builtins(program):
    """The builtins tests run with: the real ones, and ``import solution`` giving the program's module."""
    names = dict(vars(builtins))
    real_import = builtins.__import__

    def import_(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.partition(".")[0] == "solution":
            if fromlist and "*" in fromlist:
                return types.SimpleNamespace(__all__=[])  # the names resolve in the program anyway
            return Remote(program, ["m"])
        return real_import(name, globals, locals, fromlist, level)

    names["__import__"] = import_
    return names


def bind(tree, namespace, program):
    """Make the names the test uses but does not define stand for the program's objects."""
    for name, attr_only in free_names(tree).items():
        if name in namespace or name in namespace["__builtins__"]:
            continue  # a test's own name, or a builtin: never the program's
        if attr_only and name in STDLIB:  # math.isclose(...) without `import math`: our math, not the program's
            try:
                namespace[name] = __import__(name)
                continue
            except ImportError:
                pass
        namespace[name] = Remote(program, ["n", name])


def run_test(i, source, namespace, program):
    """(status, error) of one test, executed here; the program is reached only through :class:`Remote`."""
    try:
        tree = ast.parse(source, f"<test {i}>")
        code = compile(tree, f"<test {i}>", "exec", dont_inherit=True, optimize=0)
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as e:
        return "runtime_error", f"the test does not compile: {_describe(e)}"
    bind(tree, namespace, program)
    program.failure = None
    try:
        exec(code, namespace)
        status, error = "ok", ""
    except Abort as e:
        status, error = e.status, e.detail
    except AssertionError as e:
        status, error = "wrong_answer", _describe(e)
    except MemoryError as e:
        status, error = "memory_limit", _describe(e)
    except BaseException as e:  # noqa: BLE001 - whatever a test raises fails that test
        status, error = "runtime_error", _describe(e)
    if program.failure is not None:  # the program failed, even if the test caught the exception
        status, error = program.failure.status, program.failure.detail
    return status, error


def _describe(e):
    try:
        text = str(e)
    except BaseException:  # noqa: BLE001 - str() of an exception holding a dead program's object
        text = ""
    return f"{type(e).__name__}: {text}"[:200] if text else type(e).__name__


def run_tests(tests, program, results_fd):
    namespace = {"__builtins__": test_builtins(program), "__name__": "__tests__"}
    stop = None  # why the remaining tests do not run: the program failed at start-up, or time is up
    for i, source in enumerate(tests):
        if stop is None and not program.ready:
            try:
                if program.pid is None:
                    program.spawn(fork=False)  # after a crash in an earlier test
                program.start()
            except Abort as e:
                stop = e
            except OSError as e:
                stop = Abort("runtime_error", f"the program could not start: {e}")
        if stop is not None:
            status, error = stop.status, stop.detail
        else:
            status, error = run_test(i, source, namespace, program)
            if program.pid is None:
                program.ready = False
            if status == "timeout":
                stop = Abort("timeout", f"not run: the time ran out in test {i}")
        record = {"i": i, "ok": status == "ok", "status": status, "error": error}
        os.write(results_fd, (json.dumps(record) + "\n").encode())


def guard_harness():
    """Before anything of the program exists: no ptrace or /proc access by the same uid, SIGINT kills
    (rather than raising inside a test), and no imports from the work dir the program can write."""
    if ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 or ctypes.CDLL(None).prctl(PR_GET_DUMPABLE, 0, 0, 0, 0):
        sys.stderr.write("harness: cannot make itself non-dumpable; not running the tests\n")
        sys.exit(1)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != cwd]


def read_tests():
    data = b""
    while True:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        data += chunk
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    tests = json.loads(data)
    if type(tests) is not list or not all(type(t) is str for t in tests):
        raise ValueError("the tests are not a JSON list of strings")
    return tests


def main():
    if sys.argv[1] == "--worker":
        serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    started = time.monotonic()
    solution, wall_s, results_fd = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    guard_harness()
    with open(solution, encoding="utf-8", errors="replace") as f:
        source = f.read()
    try:
        compile(source, solution, "exec")
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError):
        traceback.print_exc(limit=0)
        sys.stderr.flush()
        sys.exit(COMPILE_ERROR_EXIT)
    # The harness's own deadline comes a little before the agent's kill, so it can kill the program cleanly.
    program = Program(solution, started + wall_s - min(1.0, 0.05 + 0.1 * wall_s), wall_s)
    program.spawn(fork=True)  # before the tests are read: the program's memory never holds them
    try:
        run_tests(read_tests(), program, results_fd)
    finally:
        program.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # failures are reported per test, not as the harness's exit status


if __name__ == "__main__":
    main()
