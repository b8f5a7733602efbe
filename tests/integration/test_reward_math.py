"""math-verify in tandem's worker processes: equivalences, and a comparison that never ends."""

from __future__ import annotations

import time

from reward_server.verifiers.math import MathVerifier
from services.wire import MathSpec


async def test_equivalence_and_runaway_comparisons():
    verifier = MathVerifier(workers=1, timeout_s=3.0)
    try:
        assert await verifier.equivalent("\\frac{1}{2}", "0.5") == (True, "")
        assert (await verifier.equivalent("x^2 + 2x + 1", "(x+1)^2"))[0] is True
        assert (await verifier.equivalent("3", "4"))[0] is False
        started = time.monotonic()
        # Evaluating this tower does not finish; the worker is killed and replaced.
        ok, detail = await verifier.equivalent("1", "9^{9^{9^{9^{9}}}}")
        assert ok is None and "took over" in detail
        assert time.monotonic() - started < 30
        result = await verifier.score("i", "<answer>\\frac{6}{4}</answer>", MathSpec(answer="1.5"))
        assert (result.reward, result.status) == (1.0, "ok")  # the replacement worker answers
    finally:
        await verifier.close()
