"""The actor loop: prompt groups in, scored trajectory groups out.

Runs inside a rollout server started with a run (``TANDEM_RUN_ID`` and a run
config). Who it talks to:

- the broker (Redis): admission control (``broker.Admission``), the
  ``prompts`` stream it reads, the ``trajectories`` stream it appends to,
  the weight registry it watches (``broker.WeightRegistry``);
- the reward server: one ``POST /v1/score`` per group (``RewardClient``);
- its own engine (``RolloutEngine``), directly, not over HTTP.

One group, start to end:

1. Reserve an admission slot for the loaded version. ``stale``: the learner
   is more than ``max_staleness`` versions ahead, so load the newest version
   first. ``full``: ``(eta + 1) * groups_per_step`` groups are queued or in
   flight; wait.
2. Read one prompt entry (none: give the slot back).
3. Generate its ``n`` samples with the run's sampling parameters, renewing
   the slot's lease meanwhile. A group of chat ``messages`` is rendered with
   the model's chat template and the run's ``prompt.chat_template_kwargs``
   (``engine.render``); one the template cannot render is dead-lettered.
4. Score all ``n`` completions in one ``POST /v1/score``. Items that come back
   with an infrastructure status (``sandbox_error``, ``judge_error``,
   ``reward_error`` from a python reward function: reward
   is None) are scored again, up to ``reward.retries`` more times; if any
   still fail, the group is dead-lettered and counted (``infra_dropped``),
   never trained with a made-up 0. ``reward.fail_after`` such groups in a
   row on one server (none scored between them) fail the run with the
   reward's error and an incident: a reward that fails every time ends the
   run at once instead of starving the learner.
5. Hand off: append the trajectory group (behaviour log-probs, per-sample
   versions; the group's version is its oldest sample's) and ack the prompt
   in one atomic step with the ledger's ``generated`` entry; the slot
   becomes a queued ticket until the learner acks the group. A group another
   server already handed off (a redelivery) or that the run ended meanwhile
   is not handed off twice.

The ledger (``broker.ledger``) also gets ``admitted`` when a prompt is taken
under a ticket and ``loaded`` when a version is loaded (with its checked
sha256), or ``received`` when it came by broadcast: written by the swap's own
task (``RolloutEngine.load_weights``' ``record``), so a server never serves a
version its ledger record is missing for, even when the run ends at the swap.

Up to ``actor_concurrency`` groups run at once, so vLLM batches them.

A group whose line has an ``episode`` is generated as ``n`` multi-turn episodes with tools
(``rollout_server.episodes``) in step 3, and each reward scores its episode's last model turn; one that
names a tool this server lacks is dead-lettered. Everything else is as for any group.

Failures: a malformed prompt entry or one that cannot fit the model is
dead-lettered. When the reward server is unreachable (after the client's
retries) the slot is released and the prompt entry left pending: the stream
redelivers it after the visibility timeout. When the engine dies the loop
stops with :class:`EngineDead` and the server exits non-zero.

Weights: a watcher waits on the registry (pub/sub plus polling) and loads
each newer version as soon as it is published; admission's ``stale`` answer
loads it too (whichever comes first; the engine's reload lock makes the other
a no-op). What happens to groups in flight during a reload is the engine's
policy (``reload`` module docstring): they finish on the old weights and are
tagged with the old version. With ``publish.transport = "broadcast"`` the
actor is also a member of the run's weight group (``broker.broadcast``) and
receives each version the learner announces in memory, before its files are
registered (ledger ``received``); a version it misses still comes from the
registry.

Held-out evaluation (``services.evaluate``): right after loading a version that
is due (version 0 at start when ``eval.before``, then every ``eval.every``
versions) and that no other server has claimed, the actor sends every held-out
prompt of the run to its engine at once and loads no other version until they
are generated; training groups go on generating meanwhile, in the same engine
batches. Scoring (batched) and recording the ``"eval"`` point go on in the
background. A point is recorded only if every sample came from its version. A
server catching up over several versions at once loads the due ones on the way.
The final version (``eval.after``) is due once the learner asks for it (``EvalLog.request``), which may
come after this server loaded it: a watcher looks for the request every :data:`REQUEST_POLL_S`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

import httpx

from broker import Admission, Delivery, Envelope, Keys, Stream, Ticket, WeightRegistry
from broker.broadcast import BroadcastBoard
from broker.ledger import Ledger
from broker.streams import raise_if_cancelled
from broker.weight_versions import WeightVersion
from rollout_server.engine import RolloutEngine, Sampling
from rollout_server.episodes import EpisodeGeneration, run_episodes
from rollout_server.errors import EngineDead, InvalidRequest
from rollout_server.metrics import RolloutMetrics
from rollout_server.settings import RolloutSettings
from rollout_server.tools import ToolBox
from rollout_server.transports import WeightLoadError
from services import wire
from services.clients import RewardClient, is_retryable
from services.config import RunConfig
from services.evaluate import EvalLog, due, score
from services.runs import RunStore, TransitionError
from services.timeline import Timeline
from services.watchdog import IncidentLog, Stalled, incident
from services.weightgroup import Invitation

log = logging.getLogger("tandem.rollout.actor")

HEARTBEAT_S = 10.0
LOAD_RETRY_S = 5.0
REQUEST_POLL_S = 1.0
"""How often the actor looks whether the learner asked for its loaded version's evaluation (the final one)."""
BROADCAST_HEARTBEAT_S = 5.0
"""A broadcast member renews its place on the board this often (the learner seats those seen in 30 s)."""


def reward_client(rs: RolloutSettings, redis, keys: Keys, config: RunConfig) -> RewardClient:
    """The reward server's client for one run: each call bounded by ``watchdog.score_s`` (all attempts
    together), a call past it recorded in the run's incidents."""
    source = f"rollout:{rs.name}"
    return RewardClient(rs.reward_url, rs.reward_bearer, timeout_s=rs.score_timeout_s,
                        max_total_s=config.watchdog.score_s, bound_field="watchdog.score_s",
                        incidents=IncidentLog(redis, keys, source=source), source=source)


class BadScoreResponse(Exception):
    """The reward server's answer does not match the request (a bug on its side)."""


class ScoringFailed(Exception):
    """A group's samples still had an infrastructure status after ``reward.retries`` more attempts;
    ``str(e)``: the status and the reward server's detail of the first."""


class Actor:
    """The actor loop of one rollout server for one run."""

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        redis,
        keys: Keys,
        config: RunConfig,
        reward: RewardClient,
        server_id: str,
        metrics: RolloutMetrics,
        concurrency: int = 32,
        timeline: Timeline | None = None,
        tools: ToolBox | None = None,
    ) -> None:
        if (why := config.sampling.logprobs_refusal(engine.logprobs_mode)) is not None:
            raise ValueError(f"run {keys.run_id}: {why}")
        self.engine = engine
        self.timeline = timeline or Timeline.off()
        """Spans of this server's work and waits (services.timeline; docs/trace.md names them)."""
        self.redis = redis
        self.keys = keys
        self.config = config
        self.reward = reward
        self.server_id = server_id
        self.metrics = metrics
        engine.watch(config.watchdog, IncidentLog(redis, keys, source=f"rollout:{server_id}"), f"rollout:{server_id}")
        self.tools = dataclasses.replace(tools or ToolBox(), reward=reward, sink=engine.incidents, source=engine.source,
                                         metrics=metrics)
        """What an episode's model may call (``rollout_server.tools``; python in ``reward``'s sandboxes)."""
        st = config.staleness
        self.admission = Admission(
            redis,
            keys,
            max_staleness=st.max_staleness,
            groups_per_step=config.learner.groups_per_step,
            lease_s=st.lease_s,
        )
        self.concurrency = min(concurrency, self.admission.capacity)
        self.prompts = Stream.prompts(
            redis, keys, visibility_timeout_s=st.visibility_timeout_s, max_deliveries=st.max_deliveries
        )
        self.trajectories = Stream.trajectories(redis, keys)
        self.registry = WeightRegistry(redis, keys)
        self.ledger = Ledger(redis, keys)
        self._failed_load: tuple[int, float] | None = None  # (version, monotonic time) of the last failure
        self.evals = EvalLog(redis, keys)
        self._eval_prompts: list[wire.EvalPrompt] | None = None  # read once, on the first version due
        self._hold = asyncio.Lock()
        """Held while a version is loaded and, when it is due, while its held-out prompts are generated:
        no other version is loaded meanwhile, so the evaluation measures exactly one version."""
        self._tasks: asyncio.TaskGroup | None = None  # the actor's tasks (run())
        self._unscored: list[float] = []
        """Monotonic times of the groups dropped in a row because their scoring failed (reward.fail_after)."""

    # -- top level -------------------------------------------------------------

    async def run(self) -> None:
        """Run until cancelled; raises :class:`EngineDead` when the engine dies."""
        await self.prompts.ensure_group()
        await self.trajectories.ensure_group()
        log.info(
            "actor %s on run %s: capacity %d, concurrency %d",
            self.server_id, self.keys.run_id, self.admission.capacity, self.concurrency,
        )
        async with asyncio.TaskGroup() as tg:
            self._tasks = tg
            # the version served at start (0 on a fresh run: the "before" evaluation) is evaluated,
            # if due, before any other version can load; training generation starts meanwhile
            await self._hold.acquire()
            tg.create_task(self._watch_weights())
            if self.config.publish.transport == "broadcast" and self.engine.workers > 0:
                tg.create_task(self._watch_broadcasts())
            tg.create_task(self._heartbeat())
            if self.config.eval.after:
                tg.create_task(self._watch_requests())
            await self._admit(tg)

    async def _admit(self, tg: asyncio.TaskGroup) -> None:
        slots = asyncio.Semaphore(self.concurrency)
        while True:
            await slots.acquire()
            raise_if_cancelled()
            started = False
            try:
                with self.timeline.span("admit", "admit") as span:
                    decision = await self.admission.reserve(self.engine.version, timeout_s=1.0)
                    span["reason"] = decision.reason
                self.metrics.admission.labels(decision.reason).inc()
                if decision.reason == "stale":
                    await self._catch_up()
                    continue
                if decision.ticket is None:  # full: reserve() already waited its timeout
                    continue
                try:
                    deliveries = await self.prompts.read(self.server_id, count=1, block_ms=1000)
                except BaseException:
                    # cancelled (shutdown) or Redis failed while waiting: give the slot back
                    await asyncio.shield(self.admission.release(decision.ticket))
                    raise
                if not deliveries:
                    await self.admission.release(decision.ticket)
                    continue
                await self.ledger.append("admitted", deliveries[0].envelope.group_id, server=self.server_id,
                                         loaded_version=self.engine.version, delivery=deliveries[0].deliveries)
                task = tg.create_task(self._group(deliveries[0], decision.ticket))
                task.add_done_callback(lambda _t: slots.release())
                started = True
            finally:
                if not started:
                    slots.release()

    # -- weights ---------------------------------------------------------------

    async def _watch_weights(self) -> None:
        try:
            await self._evaluate_if_due()
        finally:
            self._hold.release()  # taken for this first evaluation by run()
        while True:
            latest = await self.registry.wait_newer(self.engine.version, timeout_s=30.0)
            raise_if_cancelled()
            if latest is not None:
                await self._load(latest)

    async def _watch_broadcasts(self) -> None:
        """``publish.transport = "broadcast"``: be a member of the run's weight group (a heartbeat on the
        board) and receive each version the learner announces with a seat for this server. A version
        missed or refused here still arrives through the registry, from its files (``_watch_weights``)."""
        board = BroadcastBoard(self.redis, self.keys)
        while True:
            await board.join(self.server_id, self.engine.workers)
            a = await board.wait_seat(self.server_id, self.engine.version, timeout_s=BROADCAST_HEARTBEAT_S)
            raise_if_cancelled()
            if a is None:
                continue
            seat = Invitation(a.host, a.port, a.group, a.seats[self.server_id], a.world, a.timeout_s)
            async with self._hold:
                if a.version <= self.engine.version:
                    continue
                try:
                    with self.timeline.span("broadcast", "weights", version=a.version):
                        await self.engine.load_weights(wire.LoadWeights(version=a.version, uri=seat.uri),
                                                       in_flight=self.config.publish.reload,
                                                       record=self._recorder("received", a.version))
                except WeightLoadError as e:
                    log.error("broadcast of version %d not received (%s); its files will follow", a.version,
                              e.message)
                    continue
                await self._evaluate_if_due()

    async def _catch_up(self) -> None:
        latest = await self.registry.latest()
        if latest is None or latest.version <= self.engine.version:
            await asyncio.sleep(0.5)  # refused for a retracted version: its successor is on the way
            return
        await self._load(latest)

    async def _load(self, wv: WeightVersion) -> None:
        """Load ``wv`` (first the oldest version due for evaluation before it, if one is still
        published) and evaluate it if due, holding off other loads meanwhile."""
        async with self._hold:
            if wv.version <= self.engine.version:
                return  # loaded meanwhile by the other caller
            wv = await self._due_before(wv)
            if await self._load_version(wv):
                await self._evaluate_if_due()

    async def _due_before(self, wv: WeightVersion) -> WeightVersion:
        """The oldest version between the loaded one and ``wv`` that is due for evaluation and still in the
        registry, else ``wv``: a server that catches up over several versions at once evaluates them too."""
        cfg = self.config.eval
        if cfg.every <= 0:
            return wv
        v = (self.engine.version // cfg.every + 1) * cfg.every
        if v < wv.version and (record := await self.registry.get(v)) is not None:
            return record
        return wv

    async def _load_version(self, wv: WeightVersion) -> bool:
        """Load ``wv``; True once loaded. A refused version is retried after ``LOAD_RETRY_S`` (the
        learner may still be writing it, or a newer one will replace it)."""
        if self._failed_load is not None:
            version, at = self._failed_load
            wait = LOAD_RETRY_S - (time.monotonic() - at)
            if version == wv.version and wait > 0:
                await asyncio.sleep(wait)
        if wv.version in await self.registry.retracted():
            return False  # withdrawn by a resumed learner; it publishes the weights it holds next
        try:
            with self.timeline.span("reload", "weights", version=wv.version):
                await self.engine.load_weights(wire.LoadWeights(version=wv.version, uri=wv.uri, sha256=wv.sha256),
                                               in_flight=self.config.publish.reload,
                                               record=self._recorder("loaded", wv.version, sha256=wv.sha256))
        except WeightLoadError as e:
            self._failed_load = (wv.version, time.monotonic())
            log.error("cannot load published version %d: %s", wv.version, e.message)
            return False
        self._failed_load = None
        return True

    def _recorder(self, event: str, version: int, **fields) -> Callable[[], Awaitable[None]]:
        """What the engine awaits right after it swaps ``version`` in (``RolloutEngine.load_weights``'s
        ``record``): the ledger's ``loaded`` / ``received`` entry and the registry's in-use report. Run by the
        swap's own task, so the actor being cancelled at the swap (its run ended) cannot split them from it."""
        async def record() -> None:
            await self.ledger.append(event, server=self.server_id, version=version, **fields)
            await self.registry.report_in_use(self.server_id, version)
        return record

    # -- held-out evaluation --------------------------------------------------

    async def _evaluate_if_due(self) -> None:
        """Evaluate the loaded version if it is due and no other server claimed it. Called holding
        ``_hold``: every held-out prompt is generated (batched by vLLM with the training groups in
        flight) before another version can load; scoring and recording go on in the background."""
        version = self.engine.version
        if not due(version, self.config.eval) and version not in await self.evals.requested():
            return
        if self._eval_prompts is None:
            self._eval_prompts = await self.evals.prompts()
        if not self._eval_prompts or not await self.evals.claim(version, self.server_id):
            return
        t0 = time.monotonic()
        with self.timeline.span("eval_hold", "eval", version=version):  # no other version loads meanwhile
            samples = await asyncio.gather(*[self._eval_one(i, p) for i, p in enumerate(self._eval_prompts)])
        gen_s = time.monotonic() - t0
        self._tasks.create_task(self._score_eval(version, samples, gen_s, t0), name=f"eval-v{version}")

    async def _watch_requests(self) -> None:
        """Evaluate the loaded version once the learner asks for it (the run's final version, which this
        server may have loaded before the learner finished), unless another server claimed it."""
        asked = -1
        while True:
            await asyncio.sleep(REQUEST_POLL_S)
            version = self.engine.version
            if version != asked and version in await self.evals.requested():
                asked = version
                async with self._hold:
                    await self._evaluate_if_due()

    async def _eval_one(self, i: int, prompt: wire.EvalPrompt) -> list[wire.Sample] | None:
        """The ``eval.samples`` completions (greedy unless ``eval.temperature``) of one held-out prompt;
        None if the engine cannot take the prompt (they count as wrong). A prompt with an ``episode`` gets
        that many episodes with its tools, each sample's ``text`` the model's last turn (what is scored)."""
        s, ev = self.config.sampling, self.config.eval
        try:
            _, ids = self.engine.prompt_ids(prompt.prompt, prompt.messages, self.config.prompt.chat_template_kwargs)
        except InvalidRequest as e:
            log.warning("held-out prompt %d not generated (counted wrong): %s", i, e)
            return None
        sampling = Sampling(n=ev.samples, temperature=ev.temperature, max_tokens=max(1, min(
            s.max_tokens, self.engine.max_model_len - len(ids))), stop=tuple(s.stop), seed=i)
        if prompt.episode is not None and (unknown := self.tools.unknown(prompt.episode.tools)):
            log.warning("held-out prompt %d not generated (counted wrong): this server has no tool %r", i, unknown[0])
            return None
        try:
            self.engine.check(ids, sampling, prompt_field="prompt")
            if prompt.episode is None:
                return (await self.engine.generate(ids, sampling, source="eval")).samples
            gen = await run_episodes(self.engine, ids, sampling, prompt.episode, ev.samples, self.tools)
            return [smp.model_copy(update={"text": text}) for smp, text in zip(gen.samples, gen.texts, strict=True)]
        except (InvalidRequest, Stalled) as e:
            log.warning("held-out prompt %d not generated (counted wrong): %s", i, e)
            return None

    async def _score_eval(self, version: int, samples: list[list[wire.Sample] | None], gen_s: float,
                          t0: float) -> None:
        prompts, n = self._eval_prompts, self.config.eval.samples
        texts = [[smp.text for smp in group] if group is not None else [""] * n for group in samples]
        versions = [smp.policy_version for group in samples if group is not None for smp in group]
        if set(versions) - {version}:
            log.error("held-out evaluation of version %d used versions %s: not recorded", version, sorted(set(versions)))
            return
        try:
            result = await score(self.reward, prompts, texts, versions or [version],
                                 [None if group is None else [smp.token_ids for smp in group] for group in samples])
        except (httpx.HTTPError, Stalled) as e:
            log.error("held-out evaluation of version %d not recorded: the reward server failed: %r", version, e)
            return
        await self.evals.record(version, result, self.server_id)
        log.info("held-out accuracy of version %d: %.1f%%%s (%d prompts x %d; generated in %.1f s, %.1f s in all)",
                 version, 100 * result.accuracy, "".join(f", pass@{k} {100 * v:.1f}%" for k, v in result.pass_at.items()),
                 result.count, result.samples, gen_s, time.monotonic() - t0)

    async def _heartbeat(self) -> None:
        while True:
            await self.registry.report_in_use(self.server_id, self.engine.version)
            raise_if_cancelled()
            await asyncio.sleep(HEARTBEAT_S)

    # -- one group -------------------------------------------------------------

    async def _renew(self, ticket: Ticket, lost: asyncio.Event) -> None:
        while True:
            await asyncio.sleep(self.admission.lease_s / 3)
            renewed = await self.admission.renew(ticket)
            raise_if_cancelled()
            if not renewed:
                lost.set()
                return

    async def _drop(self, delivery: Delivery, ticket: Ticket, outcome: str, reason: str) -> None:
        """Dead-letter the prompt entry (it cannot succeed) and free the slot."""
        await self.prompts.dead_letter(delivery, reason)
        await self._dropped(delivery, ticket, outcome, reason)

    async def _dropped(self, delivery: Delivery, ticket: Ticket, outcome: str, reason: str) -> None:
        """The prompt entry is dead-lettered: free the slot, count the outcome."""
        log.warning("dropping group %s: %s", delivery.envelope.group_id, reason)
        await self.admission.release(ticket)
        self.metrics.groups.labels(outcome).inc()

    async def _group(self, delivery: Delivery, ticket: Ticket) -> None:
        lost = asyncio.Event()
        renewer = asyncio.create_task(self._renew(ticket, lost))
        # the gauge goes down on any exit, even a cancellation landing in the clean-up below (a
        # TaskGroup cancels its children again for each sibling that fails while they end)
        with self.metrics.groups_in_flight.track_inprogress():
            try:
                await self._process(delivery, ticket, lost)
            except (EngineDead, asyncio.CancelledError):
                # the slot would otherwise stay taken until its lease expires
                await asyncio.shield(self.admission.release(ticket))
                raise
            finally:
                await cancel_and_wait(renewer)

    async def _process(self, delivery: Delivery, ticket: Ticket, lost: asyncio.Event) -> None:
        pg = await wire.decode_delivery(self.prompts, delivery, wire.PromptGroup)
        if pg is None:
            await self._dropped(delivery, ticket, "malformed", "malformed prompt group (dead-lettered with the reason)")
            return
        if pg.run_id != self.keys.run_id:
            await self._drop(delivery, ticket, "malformed", f"prompt group of run {pg.run_id!r} in run {self.keys.run_id!r}")
            return
        s = self.config.sampling
        field = "messages" if pg.messages is not None else "prompt"
        try:
            text, ids = self.engine.prompt_ids(pg.prompt, pg.messages, self.config.prompt.chat_template_kwargs)
        except InvalidRequest as e:
            await self._drop(delivery, ticket, "invalid", f"cannot render the prompt: {e}")
            return
        room = self.engine.max_model_len - len(ids)
        sampling = Sampling(
            n=pg.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            # a long prompt leaves less room: cap the completion instead of refusing
            # (its finish_reason "length" tells the learner it was cut)
            max_tokens=max(1, min(s.max_tokens, room)),
            min_tokens=s.min_tokens,
            stop=tuple(s.stop),
        )
        try:
            self.engine.check(ids, sampling, prompt_field=field)
        except InvalidRequest as e:
            await self._drop(delivery, ticket, "invalid", f"cannot generate: {e}")
            return
        if pg.episode is not None and (unknown := self.tools.unknown(pg.episode.tools)):
            await self._drop(delivery, ticket, "invalid", f"episode.tools: this server has no tool {unknown[0]!r}")
            return

        t0 = time.monotonic()
        try:
            with self.timeline.span("generate", "groups", group=pg.group_id, n=pg.n):
                gen = await (self.engine.generate(ids, sampling, source="actor") if pg.episode is None
                             else run_episodes(self.engine, ids, sampling, pg.episode, pg.n, self.tools))
        except InvalidRequest as e:  # vLLM refused it (a limit our own check does not know)
            await self._drop(delivery, ticket, "invalid", f"engine refused the group: {e}")
            return
        except Stalled as e:  # past watchdog.generate_s, the engine still answering: another try may do
            return await self._retry_later(delivery, ticket, str(e))
        gen_s = time.monotonic() - t0
        self.metrics.group_gen_s.observe(gen_s)

        try:
            with self.timeline.span("score", "groups", group=pg.group_id):
                results, reward_metrics = await self._score(pg, gen.texts if isinstance(gen, EpisodeGeneration)
                                                            else [smp.text for smp in gen.samples], gen.samples)
        except httpx.HTTPStatusError as e:
            # the client has used up its own retries; the question now is whether a later delivery can succeed
            if not is_retryable(e):  # the request is wrong: repeating it cannot help
                refused = f"reward server refused the group: {e.response.text[:500]}"
                await self._drop(delivery, ticket, "score_refused", refused)
                return await self._scoring_failed(refused)  # a line the reward server refuses: every one will be
            return await self._retry_later(delivery, ticket, f"reward server error {e.response.status_code}")
        except httpx.TransportError as e:  # retryable, always (is_retryable)
            return await self._retry_later(delivery, ticket, f"reward server unreachable: {e!r}")
        except BadScoreResponse as e:
            return await self._retry_later(delivery, ticket, f"bad reward response: {e}")
        except ScoringFailed as e:
            await self.redis.hincrby(self.keys.counters, "infra_dropped", 1)
            await self._drop(delivery, ticket, "infra_dropped",
                             f"reward infrastructure failure after {self.config.reward.retries} retries: {e}")
            return await self._scoring_failed(str(e))
        self._unscored.clear()
        if lost.is_set():
            # the slot expired and may have been given to another group: handing off now
            # could exceed capacity. Leave the entry pending; it will be redelivered.
            return await self._retry_later(delivery, ticket, "admission lease expired during generation")

        samples = [
            wire.ScoredSample(**smp.model_dump(), reward=r.reward, status=r.status, components=r.components,
                              logged=r.logged, **episode)
            for smp, r, episode in zip(gen.samples, results, gen.fields if isinstance(gen, EpisodeGeneration)
                                       else [{}] * len(gen.samples), strict=True)
        ]
        traj = wire.TrajectoryGroup(
            run_id=pg.run_id,
            group_id=pg.group_id,
            prompt=text,
            prompt_token_ids=gen.prompt_token_ids,
            samples=samples,
            n=pg.n,
            policy_version=min(x.policy_version for x in samples),
            rollout_id=self.server_id,
            gen_s=gen_s,
            logprobs_mode=self.engine.logprobs_mode,
            reward_metrics=reward_metrics,
        )
        statuses: dict[str, int] = {}
        for smp in samples:
            statuses[smp.status] = statuses.get(smp.status, 0) + 1
        # an episode group's ledger entry records its episodes (tandem audit counts them)
        details = {"turns": sum(smp.turns for smp in samples), "tool_calls": sum(smp.tool_calls for smp in samples),
                    "tool_errors": sum(smp.tool_errors for smp in samples)} if isinstance(gen, EpisodeGeneration) else {}
        # a group whose samples span versions (publish.reload = "keep") records them all: tandem audit checks
        # that it was tagged with, and bounded by, the oldest
        spanned = sorted({v for smp in samples for v in smp.versions()})
        if len(spanned) > 1:
            details["versions"] = spanned
        with self.timeline.span("handoff", "groups", group=pg.group_id, version=traj.policy_version):
            handed = await self.prompts.handoff(
                delivery,
                self.trajectories,
                Envelope(pg.group_id, traj.policy_version, wire.encode(traj)),
                ticket.token,
                server=self.server_id, version=traj.policy_version, statuses=statuses,
                reward_mean=sum(smp.reward for smp in samples) / len(samples), **details,
            )
        if handed is None:
            log.warning("group %s was handed off or ended elsewhere meanwhile; this copy is discarded", pg.group_id)
            self.metrics.groups.labels("duplicate").inc()
            return
        self.metrics.groups.labels("produced").inc()

    async def _retry_later(self, delivery: Delivery, ticket: Ticket, reason: str) -> None:
        log.warning("group %s left for redelivery: %s", delivery.envelope.group_id, reason)
        await self.admission.release(ticket)
        self.metrics.groups.labels("redeliver").inc()

    async def _score(self, pg: wire.PromptGroup, texts: list[str],
                     samples: list[wire.Sample]) -> tuple[list[wire.ScoreResult], dict[str, float]]:
        """Rewards of the completions ``texts`` (sampled as ``samples``) in order, and what the reward functions
        logged with ``log_metric`` (a later attempt's value for a name wins); :class:`ScoringFailed` if
        infrastructure failures persist. A python reward function gets each sample's token ids as TRL's ``completion_ids``
        (an episode's: its model and observation tokens, as TRL's tool-calling completions hold both) and
        the learner's step at the version that generated the group as ``trainer_state``."""
        ids = [f"{pg.group_id}:{i}" for i in range(len(texts))]
        results: dict[str, wire.ScoreResult] = {}
        metrics: dict[str, float] = {}
        todo = list(range(len(texts)))
        learner = self.config.learner
        state = wire.TrainerState(
            global_step=min(min(smp.policy_version for smp in samples) * self.config.publish.every, learner.steps),
            max_steps=learner.steps, epoch=float(pg.epoch))
        for _attempt in range(self.config.reward.retries + 1):
            request = wire.ScoreRequest(
                items=[wire.ScoreItem(id=ids[i], prompt=pg.prompt or "", messages=pg.messages, completion=texts[i],
                                      completion_ids=samples[i].token_ids, spec=pg.spec) for i in todo],
                trainer_state=state,
            )
            response = await self.reward.score(request)
            metrics |= response.metrics
            by_id = {r.id: r for r in response.results}
            if set(by_id) != {ids[i] for i in todo}:
                raise BadScoreResponse(f"asked for {len(todo)} ids, got results for {sorted(by_id)[:5]}")
            todo = [i for i in todo if by_id[ids[i]].status in wire.INFRA_STATUSES]
            results.update({k: v for k, v in by_id.items() if v.status not in wire.INFRA_STATUSES})
            if not todo:
                return [results[i] for i in ids], dict(list(metrics.items())[:32])
        failed = by_id[ids[todo[0]]]
        log.warning("group %s: %d samples still %s after %d attempts: %s", pg.group_id, len(todo), failed.status,
                    self.config.reward.retries + 1, failed.detail[:500])
        raise ScoringFailed(f"{failed.status}: {failed.detail[:1000]}")

    async def _scoring_failed(self, why: str) -> None:
        """One more group in a row dropped because scoring it failed with ``why`` (infrastructure statuses after
        every retry, or a request the reward server refused: a reward model it does not list, say); at
        ``reward.fail_after`` the run fails with it (an incident says so; the learner sees the run end and
        stops)."""
        self._unscored.append(time.monotonic())
        limit = self.config.reward.fail_after
        if not limit or len(self._unscored) != limit:
            return
        error = f"the reward failed on {limit} groups in a row (reward.fail_after) on {self.server_id}: {why}"
        log.error("run %s fails: %s", self.keys.run_id, error)
        inc = incident(f"{self.server_id}'s last {limit} groups", f"a reward for any of them ({why})",
                       waited_s=self._unscored[-1] - self._unscored[0], limit_s=None, field="reward.fail_after",
                       action="every one failed to score: the run fails", source=f"rollout:{self.server_id}")
        await IncidentLog(self.redis, self.keys, source=f"rollout:{self.server_id}").append(inc)
        try:
            await RunStore(self.redis).set_state(self.keys.run_id, "failed", error=error)
        except TransitionError:
            pass  # it ended meanwhile (another server failed it first, or it was stopped)


async def cancel_and_wait(task: asyncio.Task) -> BaseException | None:
    """Cancel ``task``, wait until it has ended, and return what it failed with (None if it
    was cancelled or returned).

    Unlike ``with suppress(CancelledError): await task``, a cancellation of the *caller*
    while it waits still propagates: the suppress form swallows it too (it is the same
    exception), and a rollout server whose follower swallowed its own cancel kept polling
    for runs after SIGTERM until the supervisor killed it.
    """
    task.cancel()
    await asyncio.wait([task])
    return None if task.cancelled() else task.exception()
