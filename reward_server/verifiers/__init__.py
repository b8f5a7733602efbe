"""Verifiers: one per reward-spec ``type``; :class:`Scorer` dispatches a spec to its verifier.

Each verifier returns a :class:`~services.wire.ScoreResult`. Program failures
become statuses with a reward (usually 0); infrastructure failures
(``sandbox_error``, ``judge_error``) have ``reward=None`` and are never
scored, so the rollout side retries or drops the group.
"""
