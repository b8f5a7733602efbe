r"""The tools an episode's model may call (``rollout_server.episodes``), and the call format.

**Call format.** The model calls a tool by writing ``<tool>NAME: ARGS</tool>``; generation stops at
:data:`CLOSE` (a stop string), the call is run, and its answer is appended as the observation
``<result>OUTPUT</result>``, or ``<error>WHY</error>`` when the call is malformed, names a tool the
episode does not allow, fails or runs past its time (**Limits**). Nothing a tool does ends the
episode or loses its group: every failure is an observation the model reads. An observation is cut
to :data:`MAX_OBSERVATION_CHARS` characters.

**Tools.**

- ``calculator``: arithmetic on numbers (``+ - * / // % **``, unary signs, parentheses), parsed with
  :mod:`ast` and evaluated node by node (never ``eval``); exponents and results are bounded.
- ``python``: a Python session run in the reward server's sandboxes (``POST /v1/execute``, the same
  limits and isolation as reward code). The session lives in the rollout server, one per episode:
  each call runs the episode's earlier successful cells again (their output discarded) and then the
  new cell, in a fresh sandbox, so state carries over without any sandbox outliving its call, and no
  episode can see another's. A last line that is an expression is printed, as in a notebook. Cells
  that draw random numbers or read the clock may see other values when they are run again.
- user tools: Python functions installed beside the rollout server, named in its settings
  (``TANDEM_ROLLOUT_TOOLS``, a JSON map ``{"name": "module:function"}``), never sent as code. The
  function gets ARGS as one string and returns a string (or anything ``str()`` turns into one); a
  coroutine function is run to its end. They run in worker processes of their own
  (``rollout_server.tool_pool``), never on the server's event loop or in its threads; a call past its
  timeout kills its worker.

**Limits.** The server's operator bounds what a prompt line may ask for (:class:`ToolLimits`, the rollout
settings); a line's ``episode`` fields can lower each bound, never raise it:

- per call: the line's ``tool_timeout_s``, at most the server's ``tool_timeout_s``;
- per episode: the tool time of all its calls together, the line's ``tool_budget_s``, at most the
  server's ``tool_episode_s``; a call once it is spent is refused with an error observation;
- per server: at most ``tool_workers`` user-tool calls run at once (the pool's workers); the others wait
  for one, within their own timeout.

A call past its bound is recorded as an incident of the run (the bound's field, through
``services.watchdog.bounded``) and answered with an error observation.

Each call is counted in ``tandem_rollout_tool_calls{tool, outcome}`` (``ok``, ``error``: the tool failed,
``timeout``, ``refused``: malformed, not allowed, or the episode's tool time spent) and timed in
``tandem_rollout_tool_call_seconds{tool}``.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollout_server.tool_pool import ToolFailed, ToolPool
from services import watchdog
from services.clients import RewardClient
from services.reward_specs import Limits
from services.wire import TOOL_NAME, ExecuteRequest

if TYPE_CHECKING:
    from rollout_server.metrics import RolloutMetrics

OPEN, CLOSE = "<tool>", "</tool>"
"""A call is ``<tool>NAME: ARGS</tool>``; :data:`CLOSE` is the stop string that ends the model's turn."""
MAX_OBSERVATION_CHARS = 1000
BUILTIN = ("calculator", "python")
_CALL = re.compile(r"\s*([^\s:]*)\s*:(.*)", re.S)


class ToolError(Exception):
    """A call that cannot be answered with a result: its message becomes the ``<error>`` observation;
    ``outcome`` is how the call is counted."""

    def __init__(self, message: str, outcome: str = "error") -> None:
        super().__init__(message)
        self.outcome = outcome


@dataclass(frozen=True)
class Call:
    """One tool call as the model wrote it: ``name`` and ``args``, or ``error`` when it is malformed."""

    name: str = ""
    args: str = ""
    error: str = ""


def parse_call(text: str) -> Call | None:
    """The call the turn's ``text`` ends with, or None when it ends without one (the model is done).

    A turn stopped by :data:`CLOSE` ends with it; the call is what follows the last :data:`OPEN`
    before it. A call without an opening tag or without ``NAME:`` is returned with ``error`` set.
    """
    body = text.rstrip()
    if not body.endswith(CLOSE):
        return None
    body = body[: -len(CLOSE)]
    start = body.rfind(OPEN)
    if start < 0:
        return Call(error=f"malformed call: {CLOSE} without {OPEN}")
    m = _CALL.fullmatch(body[start + len(OPEN):])
    if m is None or not re.fullmatch(TOOL_NAME, m.group(1)):
        return Call(error=f"malformed call: write {OPEN}NAME: ARGS{CLOSE}, NAME a tool's name")
    return Call(name=m.group(1), args=m.group(2).strip())


def observation(result: str, error: bool) -> str:
    """The text appended after a call: ``<result>...</result>`` or ``<error>...</error>``, cut to size."""
    if len(result) > MAX_OBSERVATION_CHARS:
        result = result[:MAX_OBSERVATION_CHARS] + "..."
    tag = "error" if error else "result"
    return f"<{tag}>{result}</{tag}>"


# -- calculator -------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 1000
MAX_MAGNITUDE = 1e300


def calculate(expression: str) -> str:
    """The value of an arithmetic ``expression``, as text (an integer when it is one); raises
    :class:`ToolError` for anything else: names, calls, huge exponents, division by zero."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ToolError(f"not an arithmetic expression: {e.__class__.__name__}") from None
    value = _value(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or (
                abs(left) > 1 and right > 0 and right * math.log10(abs(left)) > math.log10(MAX_MAGNITUDE))):
            raise ToolError(f"{left} ** {right} is too large")
        try:
            out = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result out of range") from None
        if isinstance(out, complex) or not math.isfinite(out) or abs(out) > MAX_MAGNITUDE:
            raise ToolError("result out of range")
        return out
    raise ToolError(f"only numbers and + - * / // % ** ( ) are allowed, not {node.__class__.__name__}")


# -- python in the reward server's sandboxes --------------------------------------

_REPLAY = '''\
import ast as _ast, contextlib as _c, io as _io
_cells = {cells!r}
_g = {{"__name__": "__main__"}}
for _src in _cells[:-1]:
    with _c.redirect_stdout(_io.StringIO()), _c.redirect_stderr(_io.StringIO()):
        exec(compile(_src, "<cell>", "exec"), _g)
_tree = _ast.parse(_cells[-1])
_last = _tree.body.pop() if _tree.body and isinstance(_tree.body[-1], _ast.Expr) else None
exec(compile(_tree, "<cell>", "exec"), _g)
if _last is not None:
    _v = eval(compile(_ast.Expression(_last.value), "<cell>", "eval"), _g)
    if _v is not None:
        print(repr(_v))
'''


@dataclass
class PythonSession:
    """One episode's Python session: the cells that ran without error, replayed before each new one
    in a fresh sandbox of the reward server (module docstring)."""

    reward: RewardClient
    limits: Limits = field(default_factory=Limits)
    cells: list[str] = field(default_factory=list)

    async def run(self, code: str) -> str:
        if not code.strip():
            raise ToolError("no code to run")
        request = ExecuteRequest(code=_REPLAY.format(cells=[*self.cells, code]), limits=self.limits)
        result = await self.reward.execute(request)
        if result.status != "ok":
            detail = result.stderr.strip().splitlines()[-1:] or [f"exit code {result.exit_code}"]
            raise ToolError(f"{result.status}: {detail[0]}" + (f"\n{result.stdout}" if result.stdout else ""),
                            "timeout" if result.status == "timeout" else "error")
        self.cells.append(code)
        return result.stdout.rstrip("\n")


# -- the tool box -----------------------------------------------------------------


@dataclass(frozen=True)
class ToolLimits:
    """The operator's bounds on tool calls (the rollout server's ``tool_timeout_s`` and ``tool_episode_s``;
    module docstring, **Limits**): a line's ``episode`` fields may lower them, never raise them."""

    call_s: float = 60.0
    episode_s: float = 300.0


CALL_FIELD, EPISODE_FIELD = "TANDEM_ROLLOUT_TOOL_TIMEOUT_S", "TANDEM_ROLLOUT_TOOL_EPISODE_S"


def check_user_tools(named: dict[str, str]) -> dict[str, str]:
    """``{"name": "module:function"}`` as the settings give it; a bad name or target raises ``ValueError``
    naming the tool (whether it imports, :meth:`ToolPool.start` checks)."""
    for name, target in named.items():
        if not re.fullmatch(TOOL_NAME, name) or name in BUILTIN:
            raise ValueError(f"tool {name!r}: a user tool's name must match {TOOL_NAME} and not be {BUILTIN}")
        module, _, attr = target.partition(":")
        if not module or not attr:
            raise ValueError(f"tool {name!r}: {target!r} is not 'module:function'")
    return named


async def user_tools(named: dict[str, str], workers: int) -> ToolPool:
    """The pool of the server's user tools ``named``, started: a tool that cannot be imported raises
    ``ValueError`` (the server stops at start). The caller closes it."""
    return await ToolPool(check_user_tools(named), workers).start()


@dataclass
class ToolBox:
    """The tools this rollout server offers: the built-ins and its user tools (``user``, the pool of
    their worker processes). ``reward`` (the reward server's client) backs ``python``; ``limits`` bound
    the calls; ``sink`` records calls past their bound as incidents; ``metrics`` counts and times them."""

    reward: RewardClient | None = None
    user: ToolPool | None = None
    limits: ToolLimits = field(default_factory=ToolLimits)
    sink: watchdog.IncidentSink | None = None
    source: str = "rollout"
    metrics: RolloutMetrics | None = None

    def names(self) -> set[str]:
        return {"calculator", *(self.user.names if self.user else ()), *(["python"] if self.reward is not None else [])}

    def unknown(self, tools: list[str]) -> list[str]:
        """The tools of an episode spec this server cannot run."""
        return [t for t in tools if t not in self.names()]

    def session(self, budget_s: float | None = None) -> Session:
        """The tools of one episode whose line allows ``budget_s`` seconds of tool time (None: the server's)."""
        if budget_s is not None and budget_s < self.limits.episode_s:
            return Session(self, budget_s, "episode.tool_budget_s")
        return Session(self, self.limits.episode_s, EPISODE_FIELD)


@dataclass
class Session:
    """The tools of one episode (its own Python session, its tool time)."""

    box: ToolBox
    budget_s: float = math.inf
    budget_field: str = EPISODE_FIELD
    python: PythonSession | None = None
    calls: int = 0
    errors: int = 0
    spent_s: float = 0.0

    async def answer(self, call: Call, allowed: list[str], timeout_s: float) -> str:
        """The observation text for ``call`` within ``timeout_s`` (the line's; lowered to the server's
        and to the episode's tool time left), never an exception (but cancellation)."""
        self.calls += 1
        t0, outcome = time.monotonic(), "ok"
        try:
            result = await self._run(call, allowed, timeout_s)
        except ToolError as e:
            self.errors += 1
            outcome = e.outcome
            return observation(str(e), error=True)
        finally:
            if outcome != "refused":
                self.spent_s += time.monotonic() - t0
            if self.box.metrics is not None:
                tool = call.name if call.name in allowed else "-"  # the label set stays the allowed tools
                self.box.metrics.tool_calls.labels(tool, outcome).inc()
                self.box.metrics.tool_call_s.labels(tool).observe(time.monotonic() - t0)
        return observation(result, error=False)

    async def _run(self, call: Call, allowed: list[str], timeout_s: float) -> str:
        if call.error:
            raise ToolError(call.error, "refused")
        if call.name not in allowed:
            raise ToolError(f"unknown tool {call.name!r}; this episode allows: {', '.join(allowed) or 'none'}",
                            "refused")
        if self.spent_s >= self.budget_s:
            raise ToolError(f"this episode's tool time is spent ({self.budget_s:g} s, {self.budget_field})",
                            "refused")
        limit_s, limit_field = min((timeout_s, "episode.tool_timeout_s"), (self.box.limits.call_s, CALL_FIELD),
                                   (self.budget_s - self.spent_s, self.budget_field))
        try:
            out = await watchdog.bounded(
                self._invoke(call), what=f"tool call {call.name}", on=f"the tool {call.name!r}", limit_s=limit_s,
                field=limit_field, action="the call is answered with an error observation",
                sink=self.box.sink, source=self.box.source)
        except watchdog.Stalled:
            raise ToolError(f"the tool {call.name!r} timed out after {limit_s:.3g} s", "timeout") from None
        except ToolError:
            raise
        except ToolFailed as e:
            raise ToolError(f"the tool {call.name!r} failed: {e}") from None
        except Exception as e:  # noqa: BLE001  the sandbox client's failure is the model's to read
            raise ToolError(f"the tool {call.name!r} failed: {e.__class__.__name__}: {e}") from None
        return str(out)

    async def _invoke(self, call: Call) -> object:
        if call.name == "calculator":
            return calculate(call.args)
        if call.name == "python" and self.box.reward is not None:
            if self.python is None:
                self.python = PythonSession(self.box.reward)
            return await self.python.run(call.args)
        if self.box.user is None or call.name not in self.box.user.names:
            raise ToolError(f"this server has no tool {call.name!r}", "refused")
        return await self.box.user.call(call.name, call.args)
