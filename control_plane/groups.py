"""The prompt groups a run trains on: prompt-set lines x epochs, enqueued at run start.

Who talks to whom: ``POST /v1/runs`` turns the stored prompt-set lines
(``control_plane.prompt_sets``) into :class:`services.wire.PromptGroup`
entries here and appends them to the run's ``prompts`` stream, which rollout
servers read under admission control. The learner's consumer group on the
``trajectories`` stream is created at the same time, so nothing a rollout
server produces is missed.

Order: epoch by epoch; within epoch ``e`` the lines are shuffled by
``random.Random(data.shuffle_seed * 1_000_003 + e)`` (file order when
``shuffle_seed`` is None). ``group_id`` is ``e{epoch}-{line index}``: unique
in the run and stable across redeliveries. Lines that name no reward type
take ``reward.type`` and ``reward.extract`` from the run config
(``services.prompt_lines.line_specs``). Each group carries the line's prompt
text or chat messages as the run's ``[prompt]`` section makes them
(``services.prompt_forms.prompt_forms``).
"""

from __future__ import annotations

import random

import redis.asyncio as aioredis

from broker import Envelope, Keys, Stream
from broker.streams import NO_VERSION
from services.config import RunConfig
from services.prompt_forms import prompt_forms
from services.prompt_lines import MAX_ERRORS, LineError, line_specs
from services.wire import PromptGroup, encode


def epoch_order(count: int, epoch: int, shuffle_seed: int | None) -> list[int]:
    """Line indices (0-based) in the order epoch ``epoch`` visits them."""
    order = list(range(count))
    if shuffle_seed is not None:
        random.Random(shuffle_seed * 1_000_003 + epoch).shuffle(order)
    return order


def build_groups(run_id: str, lines: list[dict], config: RunConfig, chat: bool | None = None) -> list[PromptGroup]:
    """Every prompt group of the run, in enqueue order; ``chat``: whether the model has a chat template
    (None = unknown). Raises :class:`~services.prompt_lines.LineError` naming every bad line's spec and prompt."""
    errors = []
    try:
        specs = line_specs(lines, config)
    except LineError as e:
        errors += e.errors
    try:
        forms = prompt_forms(lines, config, chat)
    except LineError as e:
        errors += e.errors
    if errors:
        raise LineError(sorted(errors, key=lambda e: e["line"])[:MAX_ERRORS])
    groups = []
    for epoch in range(config.data.epochs):
        for index in epoch_order(len(lines), epoch, config.data.shuffle_seed):
            groups.append(
                PromptGroup(
                    run_id=run_id,
                    group_id=f"e{epoch}-{index}",
                    **forms[index].wire_fields(),
                    spec=specs[index],
                    n=config.sampling.group_size,
                    index=index,
                    epoch=epoch,
                    episode=lines[index].get("episode"),
                )
            )
    return groups


async def enqueue(redis: aioredis.Redis, keys: Keys, groups: list[PromptGroup], batch: int = 2000) -> int:
    """Create both streams' consumer groups and append ``groups`` to the prompts stream, each with
    its ledger's ``queued`` entry."""
    prompts = Stream.prompts(redis, keys)
    await prompts.ensure_group()
    await Stream.trajectories(redis, keys).ensure_group()
    for i in range(0, len(groups), batch):
        chunk = groups[i : i + batch]
        await prompts.add_many([Envelope(g.group_id, NO_VERSION, encode(g)) for g in chunk],
                               details=[{"epoch": g.epoch, "index": g.index} for g in chunk])
    return len(groups)
