"""``python`` reward: a user's Python function, named by a prompt set, run in a process pool.

Who is trusted for what:

- the operator of the reward server decides which functions exist and which may be called:
  the function is code installed in the reward server's environment (a package, or a module on
  its ``PYTHONPATH``), allowed by ``TANDEM_REWARD_FUNCTIONS`` (``module:name`` patterns, empty by
  default: nothing may be called). Code never travels in a prompt set or over the REST API;
- a prompt-set author is not trusted: a line may only *name* an allowed function and give it
  data (its ``args`` and the line's other fields, as keyword arguments). A name the allow-list
  does not match is refused before anything is imported (a 422 naming it, here and at the
  control plane's upload), so a line cannot make the server import an arbitrary module;
- the completion is the model's output: data the function judges.

How a request is scored: every ``python`` spec of the request (combined parts included) is
grouped by function, ``args``, the names of its keyword fields and the prompt's form; each group
is one call in TRL's shape, ``f(prompts=[...], completions=[...], completion_ids=[...],
trainer_state=..., log_extra=..., log_metric=..., **{field: [one value per completion]}, **args)``
(prompts as text, or, for chat prompts, as message lists with each completion
``[{"role": "assistant", "content": text}]``, TRL's conversational form), scheduled on a
``pebble.ProcessPool`` of spawned workers under ``function_timeout_s``
(``reward_server.verifiers.function_worker`` runs inside them), or handed to a :data:`Runner` that runs
them elsewhere (on Modal, a Restricted Function with no access to the workspace: ``deploy.modal_app``). Each call of a sync function is
one task (the workers run them in parallel); the calls of async functions go to one worker together
and are awaited concurrently, as TRL gathers them. What a call logs comes back with its results:
``log_extra`` columns in each result's ``logged``, ``log_metric`` values averaged in the response's
``metrics``.

A function whose required parameter no call will give (not one of TRL's keywords, not a field of the
line, not in ``args``) is refused by :meth:`Functions.check` naming the parameter, before any call. A call that raises, returns
something unusable, times out or loses its worker makes every completion in it a
``reward_error`` (an infrastructure status: no reward, the rollout side retries the group and then
drops it, never trains it with a made-up 0), the error summarised in ``detail``.

``None`` from a function (or NaN) means "no reward for this sample", as in TRL, which leaves
it out of its weighted sum: a combined spec sums the parts that gave a reward; a sample none of
whose parts gave one gets 0 with status ``no_answer``, saying so in ``detail``.

Named components (a function returning a dict of lists) are summed into the reward and carried
in :attr:`~services.wire.ScoreResult.components`; the learner logs each one's mean per step as
``reward_<name>``.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

from pebble import ProcessExpired, ProcessFuture, ProcessPool

from reward_server.verifiers.function_worker import (
    PASSED,
    Call,
    FunctionError,
    Outcome,
    Resolved,
    call,
    match,
    preload,
    resolve,
    split,
)
from reward_server.verifiers.result import infra, scored
from services.reward_specs import PythonSpec, RewardSpec, leaves_of
from services.wire import ScoreResult


@dataclass(frozen=True)
class Leaf:
    """One ``python`` spec to score: the ``where`` field path names it (``items.3.spec.parts.1.spec``)."""

    where: str
    item_id: str
    prompt: str | list[dict]
    """The prompt text, or the chat messages (then the function gets TRL's conversational shape)."""
    completion: str
    spec: PythonSpec
    completion_ids: list[int] | None = None
    """The token ids the policy sampled for ``completion``; None when the client sent none."""

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def python_leaves(spec: RewardSpec, where: str) -> list[tuple[str, PythonSpec]]:
    """``(field path, spec)`` of every python spec in ``spec``."""
    return leaves_of(spec, where, PythonSpec)


Extra = float | int | bool | str | None
"""One value a function logged with ``log_extra`` for one completion."""

Scored = ScoreResult | None
"""A python spec's verdict on one completion; None: the function gave no reward for it."""

Runner = Callable[[str, tuple], Awaitable[object]]
"""``runner(name, args)`` runs ``reward_server.verifiers.function_worker.<name>(*args)`` somewhere other
than this server's worker pool and returns its result; it raises :class:`WorkerLost` when the call was
lost, and the function's own exceptions (:class:`FunctionError`) as they are. Cancelling it (the
timeout ran out, the client went away) stops the call."""


class WorkerLost(Exception):
    """The process or container running a call ended before it answered."""


class Functions:
    """The reward functions this server may call: the allow-list, and ``workers`` processes that call them
    (or ``runner``, which calls them elsewhere).

    Without patterns there is no pool and every function is refused."""

    def __init__(self, patterns: list[str], workers: int = 2, timeout_s: float = 30.0,
                 runner: Runner | None = None) -> None:
        self.patterns = list(patterns)
        self.timeout_s = timeout_s
        self._known: dict[str, Resolved] = {}  # resolved once
        self._pending: set[ProcessFuture] = set()
        self._runner = runner
        modules = sorted({split(p)[0] for p in self.patterns})
        self._pool = (ProcessPool(max_workers=workers, initializer=preload, initargs=(modules,),
                                  context=mp.get_context("spawn")) if self.patterns and runner is None else None)

    def refusal(self, function: str) -> str | None:
        """Why the allow-list refuses ``function``; None if a pattern allows it."""
        if match(function, self.patterns) is not None:
            return None
        allowed = ", ".join(self.patterns) if self.patterns else "none: the setting is empty"
        return f"{function} is not allowed by the reward server's TANDEM_REWARD_FUNCTIONS (allowed: {allowed})"

    async def check(self, functions: Iterable[str],
                    keywords: Mapping[str, Collection[str]] | None = None) -> dict[str, str]:
        """``function -> why it cannot be called`` for each of ``functions`` that cannot; empty if all can.

        Allowed ones are imported and looked up in a worker (once: a success is remembered). ``keywords``:
        function -> the names its calls give besides TRL's own (the line's fields and ``args``); a
        function absent from it gets TRL's alone. One with a required parameter among neither is refused."""
        refused: dict[str, str] = {}
        keywords = keywords or {}
        for function in dict.fromkeys(functions):
            if function in self._known:
                why = self._unpassed(function, keywords.get(function, ()))
                if why is not None:
                    refused[function] = why
                continue
            why = self.refusal(function)
            if why is None:
                try:
                    self._known[function] = await self._run(resolve, function, match(function, self.patterns))
                except FunctionError as e:
                    why = str(e)
                except TimeoutError:
                    why = f"looking up {function} took over {self.timeout_s:g} s (function_timeout_s)"
                except WorkerLost as e:
                    why = f"the worker died looking up {function} ({e})"
                else:
                    why = self._unpassed(function, keywords.get(function, ()))
            if why is not None:
                refused[function] = why
        return refused

    def _unpassed(self, function: str, given: Collection[str]) -> str | None:
        """Why a call of resolved ``function`` giving ``given`` besides TRL's keywords would fail every time."""
        for name in self._known[function].required:
            if name.startswith("/"):
                return (f"{self._known[function].signature}: its parameter {name[1:]!r} is positional-only and "
                        "required; tandem passes everything by keyword")
            if name not in PASSED and name not in given:
                passed = ", ".join([*PASSED, *sorted(given)])
                return (f"{self._known[function].signature} requires {name!r}, which tandem does not pass "
                        f"(it passes {passed}): give {name!r} as a field of each line or in args, or a default")
        return None

    def signatures(self) -> dict[str, str]:
        """The functions resolved so far, with their signatures."""
        return {f: r.signature for f, r in self._known.items()}

    async def _run(self, fn, *args):
        """``fn(*args)`` in a worker, within ``timeout_s`` (TimeoutError); :class:`WorkerLost` if it died."""
        if self._runner is not None:
            return await asyncio.wait_for(self._runner(fn.__name__, args), self.timeout_s)
        assert self._pool is not None  # only allowed functions get here, and an allow-list makes a pool
        future = self._pool.schedule(fn, args, timeout=self.timeout_s)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        # Cancelling this await (the client went away) cancels the task; pebble then stops its worker.
        try:
            return await asyncio.wrap_future(future)
        except ProcessExpired as e:
            raise WorkerLost(f"exit code {e.exitcode}") from e

    async def score(self, leaves: list[Leaf], trainer_state: dict | None = None) -> Scoring:
        """Every leaf's verdict by its ``where``: one call per group of leaves sharing function, args,
        field names and form; the sync calls run at once (as many as there are workers), the async ones
        together in one worker. Every leaf's function has been checked (:meth:`check`)."""
        groups: dict[tuple, list[Leaf]] = {}
        for leaf in leaves:
            key = (leaf.spec.function, json.dumps(leaf.spec.args, sort_keys=True), tuple(sorted(leaf.spec.kwargs)),
                   leaf.conversational, leaf.completion_ids is None)
            groups.setdefault(key, []).append(leaf)
        batches = [[group] for group in groups.values() if not self._known[group[0].spec.function].is_async]
        together = [group for group in groups.values() if self._known[group[0].spec.function].is_async]
        if together:
            batches.append(together)
        scoring = Scoring()
        for batch, outcomes in zip(batches, await asyncio.gather(*(self._call(b, trainer_state) for b in batches)),
                                   strict=True):
            for group, outcome in zip(batch, outcomes, strict=True):
                scoring.add(group, outcome)
        return scoring

    async def _call(self, groups: list[list[Leaf]], trainer_state: dict | None) -> list[Outcome]:
        calls = []
        for leaves in groups:
            spec = leaves[0].spec
            calls.append(Call(
                function=spec.function, pattern=match(spec.function, self.patterns) or "",
                prompts=[leaf.prompt for leaf in leaves],
                completions=[[{"role": "assistant", "content": leaf.completion}] if leaf.conversational
                             else leaf.completion for leaf in leaves],
                completion_ids=None if leaves[0].completion_ids is None else [leaf.completion_ids for leaf in leaves],
                columns={name: [leaf.spec.kwargs[name] for leaf in leaves] for name in spec.kwargs},
                args=dict(spec.args), trainer_state=trainer_state))
        names = ", ".join(dict.fromkeys(c.function for c in calls))
        try:
            outcomes = await self._run(call, calls)
        except TimeoutError:
            why = (f"took over {self.timeout_s:g} s for {sum(len(c.completions) for c in calls)} completions "
                   "(function_timeout_s)")
        except WorkerLost as e:
            why = f"its worker died ({e})"
        else:
            return [o if not o.error else Outcome(error=f"{c.function}: {o.error}")
                    for c, o in zip(calls, outcomes, strict=True)]
        return [Outcome(error=f"{names}: {why}") for _ in calls]

    async def close(self) -> None:
        """End every worker; calls still waiting are cancelled."""
        if self._pool is None:
            return
        for future in list(self._pending):
            future.cancel()
        self._pool.stop()
        await asyncio.to_thread(self._pool.join)


@dataclass
class Scoring:
    """What scoring a request's python specs gave: each leaf's verdict by its ``where``, the ``log_extra``
    values logged for each item, and the ``log_metric`` values by name."""

    verdicts: dict[str, Scored] = field(default_factory=dict)
    logged: dict[str, dict[str, Extra]] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def add(self, leaves: list[Leaf], outcome: Outcome) -> None:
        if outcome.error:
            for leaf in leaves:
                self.verdicts[leaf.where] = infra(leaf.item_id, "reward_error", outcome.error)
            return
        for i, leaf in enumerate(leaves):
            mine = {name: values[i] for name, values in outcome.components.items() if values[i] is not None}
            reward = outcome.rewards[i]
            self.verdicts[leaf.where] = None if reward is None else scored(leaf.item_id, reward, "ok", components=mine)
            for column, values in outcome.logged.extra.items():
                self.logged.setdefault(leaf.item_id, {})[column] = values[i]
        for name, values in outcome.logged.metrics.items():
            self.metrics.setdefault(name, []).extend(values)
