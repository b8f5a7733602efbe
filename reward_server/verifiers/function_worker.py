"""What runs inside a reward-function worker process: import, call, check what came back.

The reward server's :class:`~reward_server.verifiers.functions.Functions` schedules these on a
``pebble.ProcessPool`` of spawned workers, so a user's function never runs in the server's own
process: one that hangs is ended by the pool's per-call timeout, one that crashes its process
takes only that worker down. This module imports nothing of tandem (the worker's memory is the
function's), and everything crossing back to the server is plain data: floats, ``None``, strings.

A function has TRL's signature, ``f(prompts, completions, **kwargs) -> list[float | None]``,
called with keywords. It may instead return a dict of such lists (named components); the
sample's reward is then their sum, ``None`` values left out.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import re
import traceback
from collections.abc import Callable, Mapping
from fnmatch import fnmatchcase

log = logging.getLogger("tandem.reward.functions")

COMPONENT_NAME = re.compile(r"^(?!mean$)[a-z][a-z0-9_]{0,39}$")
"""A component's name: it becomes the learner's metric ``reward_<name>`` (so not ``mean``: ``reward_mean``
is the reward itself). ``services.wire.COMPONENT`` is the same pattern."""
MAX_COMPONENTS = 16
"""Named components one function may return."""
ERROR_CHARS = 500
"""How much of an error a result's detail carries."""

Values = list[float | None]


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


def resolve(function: str, pattern: str) -> str:
    """In a worker: load ``function`` (raising :class:`FunctionError`); return its signature."""
    fn = load(function, pattern)
    try:
        return f"{function}{inspect.signature(fn)}"
    except (TypeError, ValueError):  # builtins and some callables have none
        return function


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


def call(function: str, pattern: str, prompts: list, completions: list, columns: dict[str, list],
         args: dict) -> tuple[Values, dict[str, Values]]:
    """In a worker: ``function(prompts=..., completions=..., **columns, **args)``, normalised.

    Raises :class:`FunctionError` (a plain message, always picklable) for whatever went wrong."""
    fn = load(function, pattern)
    try:
        out = fn(prompts=prompts, completions=completions, **columns, **args)
    except BaseException as e:  # noqa: BLE001 - the user's function may raise anything: reported, never scored;
        # SystemExit and KeyboardInterrupt too, which pebble would otherwise hand on to the server's event loop
        raise FunctionError(_summary(e)) from None
    return normalise(out, len(completions))
