"""``math`` reward: math-verify equivalence in a pebble process pool, each comparison under a timeout.

math-verify's own timeouts use ``signal.alarm``, which only works in a
process's main thread, so inside an async server they cannot be used
(https://github.com/huggingface/Math-Verify/issues/50, /55).
Here they are switched off (``parsing_timeout=None``, ``timeout_seconds=None``)
and each comparison is a task of a ``pebble.ProcessPool`` scheduled with
``timeout=timeout_s``: when one takes longer, pebble stops its worker
(SIGTERM, then SIGKILL after ``pebble.CONSTS.term_timeout``) and starts a
fresh one, and the answer counts as wrong (a pathological expression, not an
infrastructure fault). A worker that dies on its own (out of memory) fails
only the comparison it held, as ``sandbox_error``.

Workers are spawned, not forked from the server's threaded process, and
import math-verify in the pool's initializer, so that import (seconds) is
never counted against a comparison's time. The pool starts on the first
comparison; :meth:`MathVerifier.close` (the app's lifespan) ends its workers.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp

from pebble import ProcessExpired, ProcessFuture, ProcessPool

from reward_server.extract import extract
from reward_server.verifiers.result import infra, scored
from services.reward_specs import MathSpec
from services.wire import ScoreResult


def _as_latex(text: str) -> str:
    # math-verify extracts from LaTeX environments; a bare answer is boxed so it is found whole.
    text = text.strip()
    return text if text.startswith("$") or "\\boxed" in text else f"$\\boxed{{{text}}}$"


def _load() -> None:
    """Worker initializer: import math-verify before the worker takes its first task."""
    import math_verify  # noqa: F401 - the import is the point

    # Timeouts are off on purpose (pebble kills the worker instead); silence the per-call warning.
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def compare(gold: str, answer: str) -> tuple[bool, str]:
    """In a worker: (equal?, why not) for a reference and an extracted answer."""
    from math_verify import parse, verify

    try:
        return bool(verify(parse(_as_latex(gold), parsing_timeout=None),
                           parse(_as_latex(answer), parsing_timeout=None), timeout_seconds=None)), ""
    except Exception as e:  # noqa: BLE001 - sympy raises anything; the verdict is "not equal"
        return False, f"{type(e).__name__}: {e}"[:300]


class MathVerifier:
    """math-verify comparisons in ``workers`` processes, each one ended after ``timeout_s``."""

    def __init__(self, workers: int = 1, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self._pool = ProcessPool(max_workers=workers, initializer=_load, context=mp.get_context("spawn"))
        self._pending: set[ProcessFuture] = set()

    async def equivalent(self, gold: str, answer: str) -> tuple[bool | None, str]:
        """(True/False, detail); (None, detail) when the comparison timed out.

        Raises ``pebble.ProcessExpired`` when the worker died under the comparison."""
        future = self._pool.schedule(compare, (gold, answer), timeout=self.timeout_s)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        try:
            # Cancelling this await (the client went away) cancels the task; pebble then stops its worker.
            return await asyncio.wrap_future(future)
        except TimeoutError:
            return None, f"math-verify took over {self.timeout_s:g} s"

    async def score(self, item_id: str, completion: str, spec: MathSpec) -> ScoreResult:
        answer = extract(completion, spec.extract)
        if answer is None:
            return scored(item_id, 0.0, "no_answer", f"nothing to extract ({spec.extract})")
        try:
            ok, detail = await self.equivalent(spec.answer, answer[:2000])
        except ProcessExpired as e:
            return infra(item_id, "sandbox_error", f"math-verify worker died (exit code {e.exitcode})")
        if ok:
            return scored(item_id, 1.0, "ok")
        return scored(item_id, 0.0, "wrong_answer", detail or f"got {answer[:200]!r}")

    async def close(self) -> None:
        """End every worker; comparisons still waiting are cancelled (a stopped pool never answers them)."""
        for future in list(self._pending):
            future.cancel()
        self._pool.stop()
        await asyncio.to_thread(self._pool.join)
