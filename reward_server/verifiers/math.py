"""``math`` reward: math-verify equivalence, in worker processes tandem times out itself.

math-verify's own timeouts use ``signal.alarm``, which only works in a
process's main thread, so inside an async server they cannot be used
(https://github.com/huggingface/Math-Verify/issues/50, /55).
Here they are switched off (``parsing_timeout=None``, ``timeout_seconds=None``)
and each comparison runs in a child process of a small pool; when one takes
longer than ``timeout_s`` the child is killed and replaced, and the answer
counts as wrong (a pathological expression, not an infrastructure fault).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
from multiprocessing.connection import Connection

from reward_server.extract import extract
from reward_server.verifiers.result import infra, scored
from services.wire import MathSpec, ScoreResult

log = logging.getLogger("tandem.reward.math")


def _as_latex(text: str) -> str:
    # math-verify extracts from LaTeX environments; a bare answer is boxed so it is found whole.
    text = text.strip()
    return text if text.startswith("$") or "\\boxed" in text else f"$\\boxed{{{text}}}$"


def _worker(conn: Connection) -> None:
    """Child process: answer (gold, answer) pairs with True/False until the pipe closes."""
    from math_verify import parse, verify

    # Timeouts are off on purpose (tandem kills this process instead); silence the per-call warning.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    conn.send("ready")
    while True:
        try:
            gold, answer = conn.recv()
        except EOFError:
            return
        try:
            ok = bool(verify(parse(_as_latex(gold), parsing_timeout=None),
                             parse(_as_latex(answer), parsing_timeout=None), timeout_seconds=None))
            conn.send(("ok", ok))
        except Exception as e:  # noqa: BLE001 - sympy raises anything; the verdict is "not equal"
            conn.send(("error", f"{type(e).__name__}: {e}"[:300]))


class _Worker:
    def __init__(self) -> None:
        parent, child = mp.get_context("spawn").Pipe()
        self.conn = parent
        self.proc = mp.get_context("spawn").Process(target=_worker, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class MathVerifier:
    """A bounded pool of math-verify worker processes."""

    def __init__(self, workers: int = 1, timeout_s: float = 5.0, start_timeout_s: float = 120.0) -> None:
        self.size, self.timeout_s, self.start_timeout_s = workers, timeout_s, start_timeout_s
        self._idle: asyncio.Queue[_Worker] | None = None
        self._all: set[_Worker] = set()
        self._lock = asyncio.Lock()

    async def _new(self) -> _Worker:
        worker = _Worker()
        self._all.add(worker)
        loop = asyncio.get_running_loop()
        ready = await loop.run_in_executor(None, worker.conn.poll, self.start_timeout_s)
        if not ready or await loop.run_in_executor(None, worker.conn.recv) != "ready":
            self._drop(worker)
            raise RuntimeError("math-verify worker did not start")
        return worker

    def _drop(self, worker: _Worker) -> None:
        self._all.discard(worker)
        worker.kill()

    async def start(self) -> None:
        async with self._lock:
            if self._idle is None:
                workers = await asyncio.gather(*(self._new() for _ in range(self.size)))
                self._idle = asyncio.Queue()
                for w in workers:
                    self._idle.put_nowait(w)

    async def equivalent(self, gold: str, answer: str) -> tuple[bool | None, str]:
        """(True/False, detail); (None, detail) when the comparison timed out."""
        await self.start()
        assert self._idle is not None
        worker = await self._idle.get()
        loop = asyncio.get_running_loop()
        try:
            worker.conn.send((gold, answer))
            ready = await loop.run_in_executor(None, worker.conn.poll, self.timeout_s)
            if not ready:
                self._drop(worker)
                worker = await self._new()
                return None, f"math-verify took over {self.timeout_s:.0f} s"
            kind, value = worker.conn.recv()
            return (value, "") if kind == "ok" else (False, value)
        except (EOFError, OSError, BrokenPipeError):
            self._drop(worker)  # the worker died (e.g. out of memory): start a fresh one
            worker = await self._new()
            raise
        finally:
            self._idle.put_nowait(worker)

    async def score(self, item_id: str, completion: str, spec: MathSpec) -> ScoreResult:
        answer = extract(completion, spec.extract)
        if answer is None:
            return scored(item_id, 0.0, "no_answer", f"nothing to extract ({spec.extract})")
        try:
            ok, detail = await self.equivalent(spec.answer, answer[:2000])
        except (EOFError, OSError) as e:
            return infra(item_id, "sandbox_error", f"math-verify worker died: {e}")
        if ok:
            return scored(item_id, 1.0, "ok")
        return scored(item_id, 0.0, "wrong_answer", detail or f"got {answer[:200]!r}")

    async def close(self) -> None:
        for worker in list(self._all):
            self._drop(worker)
        self._idle = None
