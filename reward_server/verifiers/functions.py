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
is one call in TRL's shape, ``f(prompts=[...], completions=[...], **{field: [one value per
completion]}, **args)`` (prompts as text, or, for chat prompts, as message lists with each
completion ``[{"role": "assistant", "content": text}]``, TRL's conversational form), scheduled on a ``pebble.ProcessPool`` of spawned workers under ``function_timeout_s``
(``reward_server.verifiers.function_worker`` runs inside them). A call that raises, returns
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
from collections.abc import Iterable
from dataclasses import dataclass

from pebble import ProcessExpired, ProcessFuture, ProcessPool

from reward_server.verifiers.function_worker import (
    FunctionError,
    call,
    match,
    preload,
    resolve,
    split,
)
from reward_server.verifiers.result import infra, scored
from services.reward_specs import CombinedSpec, PythonSpec, RewardSpec
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

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def python_leaves(spec: RewardSpec, where: str) -> list[tuple[str, PythonSpec]]:
    """``(field path, spec)`` of every python spec in ``spec``."""
    if isinstance(spec, PythonSpec):
        return [(where, spec)]
    if isinstance(spec, CombinedSpec):
        return [found for i, p in enumerate(spec.parts) for found in python_leaves(p.spec, f"{where}.parts.{i}.spec")]
    return []


Scored = ScoreResult | None
"""A python spec's verdict on one completion; None: the function gave no reward for it."""


class Functions:
    """The reward functions this server may call: the allow-list, and ``workers`` processes that call them.

    Without patterns there is no pool and every function is refused."""

    def __init__(self, patterns: list[str], workers: int = 2, timeout_s: float = 30.0) -> None:
        self.patterns = list(patterns)
        self.timeout_s = timeout_s
        self._known: dict[str, str] = {}  # function -> signature, resolved once
        self._pending: set[ProcessFuture] = set()
        modules = sorted({split(p)[0] for p in self.patterns})
        self._pool = (ProcessPool(max_workers=workers, initializer=preload, initargs=(modules,),
                                  context=mp.get_context("spawn")) if self.patterns else None)

    def refusal(self, function: str) -> str | None:
        """Why the allow-list refuses ``function``; None if a pattern allows it."""
        if match(function, self.patterns) is not None:
            return None
        allowed = ", ".join(self.patterns) if self.patterns else "none: the setting is empty"
        return f"{function} is not allowed by the reward server's TANDEM_REWARD_FUNCTIONS (allowed: {allowed})"

    async def check(self, functions: Iterable[str]) -> dict[str, str]:
        """``function -> why it cannot be called`` for each of ``functions`` that cannot; empty if all can.

        Allowed ones are imported and looked up in a worker (once: a success is remembered)."""
        refused: dict[str, str] = {}
        for function in dict.fromkeys(functions):
            if function in self._known:
                continue
            why = self.refusal(function)
            if why is None:
                try:
                    self._known[function] = await self._run(resolve, function, match(function, self.patterns))
                except FunctionError as e:
                    why = str(e)
                except TimeoutError:
                    why = f"looking up {function} took over {self.timeout_s:g} s (function_timeout_s)"
                except ProcessExpired as e:
                    why = f"the worker died looking up {function} (exit code {e.exitcode})"
            if why is not None:
                refused[function] = why
        return refused

    def signatures(self) -> dict[str, str]:
        """The functions resolved so far, with their signatures."""
        return dict(self._known)

    async def _run(self, fn, *args):
        assert self._pool is not None  # only allowed functions get here, and an allow-list makes a pool
        future = self._pool.schedule(fn, args, timeout=self.timeout_s)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        # Cancelling this await (the client went away) cancels the task; pebble then stops its worker.
        return await asyncio.wrap_future(future)

    async def score(self, leaves: list[Leaf]) -> dict[str, Scored]:
        """Every leaf's verdict by its ``where``: one call per group of leaves sharing function, args
        and field names, the calls run at once (as many as there are workers)."""
        groups: dict[tuple, list[Leaf]] = {}
        for leaf in leaves:
            key = (leaf.spec.function, json.dumps(leaf.spec.args, sort_keys=True), tuple(sorted(leaf.spec.kwargs)),
                   leaf.conversational)
            groups.setdefault(key, []).append(leaf)
        done: dict[str, Scored] = {}
        for verdicts in await asyncio.gather(*(self._call(group) for group in groups.values())):
            done.update(verdicts)
        return done

    async def _call(self, leaves: list[Leaf]) -> dict[str, Scored]:
        spec = leaves[0].spec
        columns = {name: [leaf.spec.kwargs[name] for leaf in leaves] for name in spec.kwargs}
        completions = [[{"role": "assistant", "content": leaf.completion}] if leaf.conversational else leaf.completion
                       for leaf in leaves]
        try:
            rewards, components = await self._run(
                call, spec.function, match(spec.function, self.patterns),
                [leaf.prompt for leaf in leaves], completions, columns, dict(spec.args))
        except FunctionError as e:
            return self._failed(leaves, f"{spec.function}: {e}")
        except TimeoutError:
            return self._failed(leaves, f"{spec.function} took over {self.timeout_s:g} s for {len(leaves)} "
                                        "completions (function_timeout_s)")
        except ProcessExpired as e:
            return self._failed(leaves, f"{spec.function}: its worker died (exit code {e.exitcode})")
        out: dict[str, Scored] = {}
        for i, leaf in enumerate(leaves):
            mine = {name: values[i] for name, values in components.items() if values[i] is not None}
            out[leaf.where] = None if rewards[i] is None else scored(leaf.item_id, rewards[i], "ok", components=mine)
        return out

    @staticmethod
    def _failed(leaves: list[Leaf], detail: str) -> dict[str, Scored]:
        return {leaf.where: infra(leaf.item_id, "reward_error", detail) for leaf in leaves}

    async def close(self) -> None:
        """End every worker; calls still waiting are cancelled."""
        if self._pool is None:
            return
        for future in list(self._pending):
            future.cancel()
        self._pool.stop()
        await asyncio.to_thread(self._pool.join)
