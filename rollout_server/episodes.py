"""Multi-turn episodes: the model writes, calls a tool, reads its observation, and goes on.

A prompt group whose line has an ``episode`` (``services.wire.EpisodeSpec``) is generated here instead of
in one ``generate`` call; the actor (``rollout_server.actor``) calls :func:`run_episodes` and scores and
hands off the group as any other, one unit for admission, staleness, the ledger and the audit.

One episode, token in and token out:

1. Generate one turn from the token ids so far (the prompt's, then every completion token in order) with
   the run's sampling parameters, :data:`~rollout_server.tools.CLOSE` added as a stop string kept in the
   text. The turn's token ids and behaviour log-probs are kept exactly as vLLM returned them, and the turn
   is tagged with the weight version vLLM labelled its tokens with. ``sampling.min_tokens`` counts the
   model's tokens over the whole episode (a turn asks for what is left of it). vLLM checks no stop string
   before a request's ``min_tokens``, so a call the model closes early would run on unseen: the turn is
   cut after the token that completes the first :data:`~rollout_server.tools.CLOSE` (where vLLM's stop
   would have ended it; the tokens after it are dropped, those kept are unchanged), and the call is
   answered.
2. A turn that ends with a call (``<tool>NAME: ARGS</tool>``, ``rollout_server.tools``) gets it answered:
   the observation's text is tokenised once, on its own and literally (``engine.tokenize(special=False)``:
   a special token's text is split into ordinary tokens, so a tool cannot end the turn), and its ids are appended
   with mask 0. Earlier turns are never decoded and tokenised again: the next turn's prompt is the exact
   ids the model generated and read.
3. The episode ends when a turn ends without a call (end of sequence, or one of the run's stop strings),
   after ``max_turns`` turns of the model (a call in the last one is not answered), or when the budget is
   spent: ``max_tokens`` completion tokens in all, the model's and the observations' (default: the run's
   ``sampling.max_tokens``), and the model's context. An observation that does not fit is cut and ends
   the episode with ``finish_reason`` ``"length"``.

The sample (``services.wire.ScoredSample``) holds every completion token: ``mask`` 1 on the model's own
(trained, with their behaviour log-probs), 0 on observations (log-prob 0, never trained); ``turn_versions``
per model turn, ``policy_version`` the oldest; ``tool_calls`` and ``tool_errors``. Its ``text`` is the whole
transcript; the reward scores the text of the model's **last turn** only (:attr:`EpisodeGeneration.texts`),
so nothing a tool prints can be scored as the model's answer.

The n episodes of a group run at once (each turn is its own engine request, batched by vLLM with every
other request in flight), so while one episode waits on a tool the engine generates for the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

from rollout_server.engine import Generation, RolloutEngine, Sampling
from rollout_server.tools import CLOSE, Session, ToolBox, parse_call
from services.wire import EpisodeSpec, Sample


@dataclass(frozen=True)
class EpisodeGeneration(Generation):
    """The n episodes of a group: ``samples`` as any generation's (every completion token), ``texts`` the
    text each reward scores (the model's last turn) and ``fields`` each sample's episode fields of
    ``ScoredSample`` (mask, turns, turn_versions, tool_calls, tool_errors)."""

    texts: list[str]
    fields: list[dict]


async def run_episodes(engine: RolloutEngine, prompt_ids: list[int], sampling: Sampling, spec: EpisodeSpec,
                       n: int, tools: ToolBox) -> EpisodeGeneration:
    """Run ``n`` episodes of ``spec`` from ``prompt_ids`` at once. Raises what ``engine.generate`` raises
    (``InvalidRequest``, ``Stalled``, ``EngineDead``); a tool never makes it raise. A ``sampling.seed`` (held-out
    evaluation's) gives episode k the seed ``seed * n + k``: n episodes of one seed would be n copies."""
    done = await asyncio.gather(*[
        run_episode(engine, prompt_ids, sampling if sampling.seed is None
                    else dataclasses.replace(sampling, seed=sampling.seed * n + k), spec,
                    tools.session(spec.tool_budget_s))
        for k in range(n)])
    return EpisodeGeneration(list(prompt_ids), [d[0] for d in done], [d[1] for d in done], [d[2] for d in done])


async def run_episode(engine: RolloutEngine, prompt_ids: list[int], sampling: Sampling, spec: EpisodeSpec,
                      tools: Session) -> tuple[Sample, str, dict]:
    """One episode: (its sample, the text its reward scores, its ``ScoredSample`` episode fields)."""
    budget = spec.max_tokens or sampling.max_tokens
    stop = (*sampling.stop, CLOSE) if CLOSE not in sampling.stop else sampling.stop
    ids: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    versions: list[int] = []
    pieces: list[str] = []
    last = ""
    finish = "stop"
    for turn in range(spec.max_turns):
        room = min(budget - len(ids), engine.max_model_len - len(prompt_ids) - len(ids))
        if room < 1:
            finish = "length"
            break
        turn_sampling = dataclasses.replace(sampling, n=1, max_tokens=min(sampling.max_tokens, room), stop=stop,
                                            include_stop=True, min_tokens=max(0, sampling.min_tokens - sum(mask)))
        out = first_call(engine, (await engine.generate(list(prompt_ids) + ids, turn_sampling,
                                                        source="episode")).samples[0])
        ids += out.token_ids
        logprobs += out.logprobs
        mask += [1] * len(out.token_ids)
        versions.append(out.policy_version)
        pieces.append(out.text)
        last, finish = out.text, out.finish_reason
        call = parse_call(out.text) if out.finish_reason == "stop" else None
        if call is None or turn == spec.max_turns - 1:
            break
        text = await tools.answer(call, spec.tools, spec.tool_timeout_s)
        obs = engine.tokenize(text, special=False)
        room = min(budget - len(ids), engine.max_model_len - len(prompt_ids) - len(ids))
        if len(obs) >= room:  # no room left for the model to read the answer and write again
            obs, finish = obs[:room], "length"
        ids += obs
        logprobs += [0.0] * len(obs)
        mask += [0] * len(obs)
        pieces.append(text)
        if finish == "length":
            break
    sample = Sample(token_ids=ids, logprobs=logprobs, text="".join(pieces), finish_reason=finish,
                    policy_version=min(versions))
    return sample, last, {"mask": mask, "turns": len(versions), "turn_versions": versions,
                          "tool_calls": tools.calls, "tool_errors": tools.errors}


def first_call(engine: RolloutEngine, out: Sample) -> Sample:
    """``out`` (one turn) up to the token that completes its first :data:`CLOSE`, as vLLM's stop would have
    ended it had ``min_tokens`` not held the stop strings back (module docstring); ``out`` when that is
    where it ends already."""
    end = out.text.find(CLOSE)
    if end < 0 or end + len(CLOSE) == len(out.text):
        return out

    def text(k: int) -> str:  # the first k tokens' text, as vLLM detokenizes a completion
        return engine.tokenizer.decode(out.token_ids[:k], skip_special_tokens=True)

    lo, hi = 1, len(out.token_ids)  # bisect for the fewest tokens whose text holds a CLOSE (all of them do)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if CLOSE in text(mid) else (mid + 1, hi)
    cut = text(hi)
    return Sample(token_ids=out.token_ids[:hi], logprobs=out.logprobs[:hi], text=cut[: cut.find(CLOSE) + len(CLOSE)],
                  finish_reason="stop", policy_version=out.policy_version,
                  token_versions=[(i, v) for i, v in out.token_versions if i < hi] if out.token_versions else [])
