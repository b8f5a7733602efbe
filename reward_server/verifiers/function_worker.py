"""What runs inside a reward-function worker process: import, call, check what came back.

The reward server's :class:`~reward_server.verifiers.functions.Functions` schedules these on a
``pebble.ProcessPool`` of spawned workers, so a user's function never runs in the server's own
process: one that hangs is ended by the pool's per-call timeout, one that crashes its process
takes only that worker down. This module imports nothing of tandem (the worker's memory is the
function's), and everything crossing back to the server is plain data: floats, ``None``, strings.

A function has TRL's signature, ``f(prompts, completions, **kwargs) -> list[float | None]``,
called with keywords: what TRL 1.16's ``GRPOTrainer._calculate_rewards`` passes (:data:`PASSED`:
``completion_ids``, ``trainer_state``, ``log_extra``, ``log_metric`` besides the prompts, the
completions and the dataset columns). It may instead return a dict of such lists (named
components); the sample's reward is then their sum, ``None`` values left out. An ``async def``
function (any callable whose call returns an awaitable) is awaited, and the async calls of one
batch are awaited together, as TRL gathers its async reward functions.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import re
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from types import SimpleNamespace

log = logging.getLogger("tandem.reward.functions")

COMPONENT_NAME = re.compile(r"^(?!mean$)[a-z][a-z0-9_]{0,39}$")
"""A component's name: it becomes the learner's metric ``reward_<name>`` (so not ``mean``: ``reward_mean``
is the reward itself). ``services.wire.COMPONENT`` is the same pattern."""
MAX_COMPONENTS = 16
"""Named components one function may return."""
ERROR_CHARS = 500
"""How much of an error a result's detail carries."""

Values = list[float | None]

PASSED = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
"""Keywords every call passes, as TRL does; the line's fields and ``args`` come on top
(``services.reward_specs.TRL_KEYWORDS`` is the same set: a line may not give them)."""
MAX_LOGGED = 16
"""Metric names and extra columns one call may log, each."""
LOGGED_CHARS = 200
"""A logged extra value that is not a number is kept as text, this long at most."""


@dataclass
class Logged:
    """What a call logged through ``log_extra`` (columns, one value per completion) and ``log_metric``."""

    extra: dict[str, list] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def log_extra(self, column: str, values: list) -> None:
        if column not in self.extra and len(self.extra) >= MAX_LOGGED:
            raise FunctionError(f"log_extra: more than {MAX_LOGGED} columns")
        self.extra.setdefault(str(column), []).extend(_plain(v) for v in values)

    def log_metric(self, name: str, value: float) -> None:
        if name not in self.metrics and len(self.metrics) >= MAX_LOGGED:
            raise FunctionError(f"log_metric: more than {MAX_LOGGED} metrics")
        number = float(value)
        if not math.isfinite(number):
            raise FunctionError(f"log_metric({name!r}): {number} is not finite")
        self.metrics.setdefault(str(name), []).append(number)


def _plain(value: object) -> float | int | bool | str | None:
    """A logged extra value as plain data that crosses back to the server."""
    if value is None or isinstance(value, bool | int | float):
        return value
    return str(value)[:LOGGED_CHARS]


class FunctionError(Exception):
    """The function could not be loaded, raised, or returned something unusable: ``str(e)`` says which."""


def split(function: str) -> tuple[str, str]:
    """``"pkg.mod:name"`` -> ``("pkg.mod", "name")``."""
    module, _, name = function.partition(":")
    return module, name


def is_glob(pattern_name: str) -> bool:
    return any(c in pattern_name for c in "*?[")


def match(function: str, patterns: list[str]) -> str | None:
    """The allow-list pattern that lets ``function`` be called (an exact one before a glob), or None.

    A pattern is ``module:name``: the module is named exactly (no wildcard: what may be imported is
    decided by name, before anything is imported), the name may be a glob (``my_rewards:*``)."""
    module, name = split(function)
    found = [p for p in patterns if split(p)[0] == module and fnmatchcase(name, split(p)[1])]
    found.sort(key=lambda p: is_glob(split(p)[1]))
    return found[0] if found else None


def preload(modules: list[str]) -> None:
    """Worker initializer: import the allowed modules before the first call, so a slow import (a
    tokenizer, a parser) is never counted against a call's timeout. A module that fails to import
    is logged and left: the check that names it reports the error."""
    logging.basicConfig(level=logging.WARNING)
    for module in modules:
        try:
            importlib.import_module(module)
        except BaseException as e:  # noqa: BLE001 - any import error is reported by resolve(), naming it
            log.warning("reward functions: cannot import %s: %s: %s", module, type(e).__name__, e)


def _summary(e: BaseException) -> str:
    """``Type: message (file:line in function)`` of the innermost frame, short."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" ({frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(e).__name__}: {e}"[: ERROR_CHARS - len(where)] + where


def load(function: str, pattern: str) -> Callable:
    """The callable ``function`` names, allowed by ``pattern``; raises :class:`FunctionError`.

    Under a glob pattern only public functions defined in that module qualify (not what it imported,
    e.g. ``from os import system``, nor classes); a pattern that names the function exactly may
    name any callable (a class instance, a ``functools.partial``)."""
    module_name, name = split(function)
    try:
        module = importlib.import_module(module_name)
    except BaseException as e:  # noqa: BLE001 - the user's module may raise anything on import, sys.exit() too
        raise FunctionError(f"cannot import {module_name}: {_summary(e)}") from None
    obj = getattr(module, name, None)
    if obj is None:
        raise FunctionError(f"module {module_name} has no {name!r}")
    if is_glob(split(pattern)[1]):
        if name.startswith("_"):
            raise FunctionError(f"{name!r} is private; a glob pattern ({pattern}) allows public functions only")
        if not inspect.isfunction(obj) or obj.__module__ != module_name:
            raise FunctionError(f"{function} is not a function defined in {module_name}; a glob pattern "
                                f"({pattern}) allows only those (name it exactly to allow it)")
    elif not callable(obj):
        raise FunctionError(f"{function} is not callable ({type(obj).__name__})")
    return obj


@dataclass(frozen=True)
class Resolved:
    """What the server needs to know of a function before calling it."""

    signature: str
    required: tuple[str, ...]
    """Parameters without a default that must come by keyword; a required positional-only one is listed as
    ``"/name"`` (no call by keyword can give it)."""
    is_async: bool


def resolve(function: str, pattern: str) -> Resolved:
    """In a worker: load ``function`` (raising :class:`FunctionError`); its signature and required parameters."""
    fn = load(function, pattern)
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some callables have none
        return Resolved(function, (), is_async)
    required = tuple(("/" if p.kind is p.POSITIONAL_ONLY else "") + p.name for p in sig.parameters.values()
                     if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    return Resolved(f"{function}{sig}", required, is_async)


def _number(value: object, where: str) -> float | None:
    """A returned value as a float, ``None`` (no reward), or :class:`FunctionError`. NaN counts as
    ``None``: TRL turns a ``None`` into NaN and leaves NaN out of its sum, so they mean the same."""
    if value is None:
        return None
    if isinstance(value, str | bytes) or not hasattr(value, "__float__"):
        raise FunctionError(f"{where} is {type(value).__name__} {str(value)[:50]!r}; expected a number or None")
    number = float(value)  # numpy and torch scalars, bool, int
    if math.isnan(number):
        return None
    if math.isinf(number):
        raise FunctionError(f"{where} is {number}; rewards must be finite")
    return number


def _values(out: object, n: int, where: str) -> Values:
    if isinstance(out, str | bytes | Mapping) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
        raise FunctionError(f"{where} is {type(out).__name__}; expected a list of {n} numbers or None")
    if len(out) != n:
        raise FunctionError(f"{where} has {len(out)} values for {n} completions")
    return [_number(v, f"{where}[{i}]") for i, v in enumerate(out)]


def normalise(out: object, n: int) -> tuple[Values, dict[str, Values]]:
    """(the reward of each of the ``n`` completions, named components) from what a function returned."""
    if not isinstance(out, Mapping):
        return _values(out, n, "the result"), {}
    if not 1 <= len(out) <= MAX_COMPONENTS:
        raise FunctionError(f"the result has {len(out)} components; 1 to {MAX_COMPONENTS} are allowed")
    components = {}
    for name, values in out.items():
        if not isinstance(name, str) or not COMPONENT_NAME.match(name):
            raise FunctionError(f"component name {str(name)[:50]!r} must match {COMPONENT_NAME.pattern}")
        components[name] = _values(values, n, f"component {name!r}")
    rewards: Values = []
    for i in range(n):
        present = [v[i] for v in components.values() if v[i] is not None]
        rewards.append(sum(present) if present else None)
    return rewards, components


@dataclass(frozen=True)
class Call:
    """One call of a function over a batch of completions (plain data: it crosses to the worker)."""

    function: str
    pattern: str
    prompts: list
    completions: list
    completion_ids: list[list[int]] | None
    """The sampled token ids of each completion; None: the client sent none, and the keyword is left out."""
    columns: dict[str, list]
    args: dict
    trainer_state: dict | None
    """``services.wire.TrainerState``'s fields; the function gets them as attributes (``.global_step``)."""


@dataclass(frozen=True)
class Outcome:
    """A call's rewards, components and what it logged; ``error`` instead when it failed."""

    rewards: Values = field(default_factory=list)
    components: dict[str, Values] = field(default_factory=dict)
    logged: Logged = field(default_factory=Logged)
    error: str = ""


def _start(c: Call, logged: Logged) -> object:
    fn = load(c.function, c.pattern)
    given = {"completion_ids": c.completion_ids} if c.completion_ids is not None else {}
    state = None if c.trainer_state is None else SimpleNamespace(**c.trainer_state)
    return fn(prompts=c.prompts, completions=c.completions, **given, trainer_state=state,
              log_extra=logged.log_extra, log_metric=logged.log_metric, **c.columns, **c.args)


def _outcome(out: object, n: int, logged: Logged) -> Outcome:
    try:
        rewards, components = normalise(out, n)
    except FunctionError as e:
        return Outcome(error=str(e))
    for column, values in logged.extra.items():
        if len(values) != n:
            return Outcome(error=f"log_extra({column!r}) logged {len(values)} values for {n} completions")
    return Outcome(rewards, components, logged)


def call(calls: list[Call]) -> list[Outcome]:
    """In a worker: each call ``function(prompts=..., completions=..., completion_ids=..., trainer_state=...,
    log_extra=..., log_metric=..., **columns, **args)``, normalised, in order. The awaitables that async
    functions return are awaited together (``asyncio.gather``), as TRL awaits its async reward functions.

    A call that fails gives an :class:`Outcome` with its ``error``: a plain message, always picklable."""
    outcomes: list[Outcome | None] = [None] * len(calls)
    pending: dict[int, tuple[object, Logged]] = {}
    for i, c in enumerate(calls):
        logged = Logged()
        try:
            out = _start(c, logged)
        except FunctionError as e:
            outcomes[i] = Outcome(error=str(e))
            continue
        except BaseException as e:  # noqa: BLE001 - the user's function may raise anything: reported, never scored;
            # SystemExit and KeyboardInterrupt too, which pebble would otherwise hand on to the server's event loop
            outcomes[i] = Outcome(error=_summary(e))
            continue
        if inspect.isawaitable(out):
            pending[i] = (out, logged)
        else:
            outcomes[i] = _outcome(out, len(c.completions), logged)
    if pending:
        async def together() -> list:
            return await asyncio.gather(*(aw for aw, _ in pending.values()), return_exceptions=True)

        try:
            awaited = asyncio.run(together())
        except BaseException as e:  # noqa: BLE001 - SystemExit and the like escape gather's return_exceptions
            awaited = [e] * len(pending)
        for (i, (_, logged)), out in zip(pending.items(), awaited, strict=True):
            outcomes[i] = (Outcome(error=_summary(out)) if isinstance(out, BaseException)
                           else _outcome(out, len(calls[i].completions), logged))
    return [o if o is not None else Outcome(error="not called") for o in outcomes]
