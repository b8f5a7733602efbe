"""Every payload that crosses a process boundary, defined once.

Producers and consumers import these models; nothing else defines a payload.
Hot payloads (the ``prompts`` and ``trajectories`` stream entries) are
encoded with :func:`encode` (msgpack of the validated fields, never pickle)
and read back with :func:`decode`, which validates again: a receiver can
rely on every invariant stated in a docstring here.

Who sends what:

- control plane -> ``prompts`` stream: :class:`PromptGroup`
- rollout server -> reward server ``POST /v1/score``: :class:`ScoreRequest` -> :class:`ScoreResponse`
- anyone -> reward server ``POST /v1/execute``: :class:`ExecuteRequest` -> :class:`ExecuteResult`
- rollout server -> ``trajectories`` stream: :class:`TrajectoryGroup`
- anyone -> rollout server ``POST /v1/generate``: :class:`GenerateRequest` -> :class:`GenerateResponse`
- learner -> broker registry -> rollout servers: ``broker.weight_versions.WeightVersion`` (defined beside
  its registry, the broker being the layer below this module)
  (``POST /v1/weights``: :class:`LoadWeights` -> :class:`WeightsStatus`)
- control plane <-> learner / rollout servers, through Redis (``services.runs``):
  :class:`RunRecord` (the run registry) and :class:`MetricPoint` (its time series)
- clients (``tandem submit/status``, the dashboard) -> control plane:
  :class:`PromptSetInfo`, :class:`CreateRun` -> :class:`RunCreated`,
  :class:`RunStatus` (with the run's :class:`Incident` records), :class:`MetricsPage`

The reward specs these payloads carry (``spec``, ``limits``) are defined in
:mod:`services.reward_specs`.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Annotated, Literal, TypeVar

import msgpack
import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    WrapValidator,
    model_validator,
)

from services.reward_specs import FUNCTION_NAME, MODEL_NAME, Limits, RewardSpec
from services.run_states import RunState

if TYPE_CHECKING:  # the payload types import nothing of the broker at run time
    from broker.streams import Delivery, Stream


class Wire(BaseModel):
    """Base of every wire type: unknown fields are an error, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _packed(dtype: str, check, what: str):
    """A list field that travels as a packed little-endian array in the binary encoding.

    ``check(ndarray) -> bool`` is the element invariant; it runs vectorised
    on packed input and on the list from JSON input alike.
    """
    def validate(value, handler):
        if isinstance(value, bytes | bytearray):
            a = np.frombuffer(value, dtype=dtype)
            out = a.tolist()
        else:
            out = handler(value)
            try:
                a = np.asarray(out, dtype=dtype) if out else np.empty(0, dtype=dtype)
            except OverflowError as e:  # a 4xx naming the field, not a 500
                raise ValueError(f"value out of range for {dtype}: {e}") from e
        if a.size and not check(a):
            raise ValueError(what)
        return out

    def serialize(value: list, info):
        if info.mode_is_json():
            return value
        try:
            return np.asarray(value, dtype=dtype).tobytes()
        except OverflowError as e:
            raise ValueError(f"value out of range for {dtype}: {e}") from e

    return WrapValidator(validate), PlainSerializer(serialize, when_used="always")


# Long numeric lists travel as packed arrays in the binary encoding (int32
# token ids, float64 log-probs): smaller and several times faster to decode
# than msgpack lists. JSON (HTTP) keeps plain lists.
TokenIds = Annotated[list[int], *_packed("<i4", lambda a: a.min() >= 0, "token ids must be >= 0")]
LogProbs = Annotated[
    list[float],
    *_packed("<f8", lambda a: bool(np.isfinite(a).all() and a.max() <= 1e-4), "logprobs must be finite and <= 0"),
]
TokenMask = Annotated[
    list[Annotated[int, Field(ge=0, le=1)]], *_packed("<u1", lambda a: bool((a <= 1).all()), "mask values must be 0 or 1")
]


# --------------------------------------------------------------------------
# Scoring and execution (the specs themselves: services.reward_specs)

ScoreStatus = Literal[
    "ok",  # scored; reward says how well
    "wrong_answer",
    "no_answer",  # nothing could be extracted
    "runtime_error",
    "timeout",
    "memory_limit",
    "output_limit",
    "compile_error",
    "sandbox_error",  # infrastructure: never scored, the group is retried or dropped
    "judge_error",  # infrastructure: the judge endpoint failed
    "reward_error",  # infrastructure: a python reward function raised, timed out or returned garbage
]
INFRA_STATUSES = frozenset({"sandbox_error", "judge_error", "reward_error"})

COMPONENT = r"^(?!mean$)[a-z][a-z0-9_]{0,39}$"
"""A reward component's name (a python reward function's dict keys): the learner logs ``reward_<name>``
(``mean`` would clash with ``reward_mean``)."""


def _components(value: dict[str, float]) -> dict[str, float]:
    for name, v in value.items():
        if not re.fullmatch(COMPONENT, name):
            raise ValueError(f"component name {name[:50]!r} must match {COMPONENT}")
        if not math.isfinite(v):
            raise ValueError(f"component {name} must be finite")
    return value


Components = Annotated[dict[str, float], Field(max_length=64), AfterValidator(_components)]
"""Named parts of a reward (what a python reward function returned by name), each finite."""


class ScoreItem(Wire):
    """One completion to score. ``prompt`` (text) or ``messages`` (chat turns) is what the model was
    asked: a ``python`` spec passes it to its function as TRL would (``prompts``: strings, or lists of
    messages with each completion then ``[{"role": "assistant", "content": ...}]``), and
    ``completion_ids`` (the token ids the policy sampled; an episode's: docs/episodes.md) as TRL's
    ``completion_ids``; the other verifiers ignore them. Without ``completion_ids`` a function is called
    without that keyword."""

    id: str = Field(min_length=1, max_length=256)
    prompt: str = ""
    messages: Messages | None = None
    completion: str
    completion_ids: TokenIds | None = None
    spec: RewardSpec


class TrainerState(Wire):
    """``trainer_state`` as a python reward function gets it: the fields of TRL's ``TrainerState`` that mean
    something here, taken from the weight version that generated the completions (generation runs ahead of
    training, so this is the learner's step then, not now)."""

    global_step: int = Field(ge=0, description="Optimizer steps the learner had taken when that version was "
                                               "published (version x publish.every).")
    max_steps: int = Field(ge=0, description="The run's learner.steps.")
    epoch: float = Field(ge=0, description="The pass over the prompt set the group's line belongs to (0, 1, ...).")


class ScoreRequest(Wire):
    """``POST /v1/score``: one batch, typically the G completions of a group; ``trainer_state`` is passed
    to python reward functions (None when the batch is not a run's group)."""

    items: list[ScoreItem] = Field(min_length=1, max_length=4096)
    trainer_state: TrainerState | None = None


class ScoreResult(Wire):
    """``reward`` is None exactly when ``status`` is an infrastructure failure. ``components``: the named
    parts a python reward function returned (their sum is in ``reward``); empty otherwise."""

    id: str
    reward: float | None
    status: ScoreStatus
    detail: str = ""
    components: Components = Field(default_factory=dict)
    logged: dict[str, float | int | bool | str | None] = Field(
        default_factory=dict, description="What python reward functions logged for this completion with "
                                          "log_extra (TRL's completions-table columns), by column.")

    @model_validator(mode="after")
    def _reward_iff_scored(self) -> ScoreResult:
        if (self.reward is None) != (self.status in INFRA_STATUSES):
            raise ValueError("reward must be None exactly for infrastructure statuses")
        if self.reward is not None and not math.isfinite(self.reward):
            raise ValueError("reward must be finite")
        return self


class ScoreResponse(Wire):
    """Results in the order of the request's items; ``metrics``: the mean of the values python reward
    functions logged with ``log_metric`` while scoring it, by name (TRL averages them the same way)."""

    results: list[ScoreResult]
    metrics: dict[str, float] = Field(default_factory=dict)


class CheckFunctions(Wire):
    """``POST /v1/check``: may the reward server call these python reward functions, and score with these
    reward models? The control plane asks before it stores a prompt set or creates a run that names them."""

    functions: list[Annotated[str, Field(max_length=200, pattern=FUNCTION_NAME)]] = Field(
        default_factory=list, max_length=256)
    keywords: dict[str, list[Annotated[str, Field(max_length=64)]]] = Field(
        default_factory=dict, max_length=256,
        description="function -> the keywords its calls give besides TRL's own (the line's fields and args); a "
                    "function not named here gets TRL's alone. One with a required parameter that no call gives "
                    "is refused, naming it.")
    models: list[Annotated[str, Field(pattern=MODEL_NAME)]] = Field(
        default_factory=list, max_length=256, description="Reward models by name (``reward_model`` specs).")

    @model_validator(mode="after")
    def _something(self) -> CheckFunctions:
        if not self.functions and not self.models:
            raise ValueError("functions, models: name at least one function or model to check")
        return self


class FunctionsChecked(Wire):
    """``allowed``: function -> its signature; ``refused``: function or reward model -> why the reward server
    will not call it (not on its allow-list, not importable, not a function; a model it does not list), each
    named once."""

    allowed: dict[str, str]
    refused: dict[str, str]


ExecStatus = Literal[
    "ok", "runtime_error", "timeout", "memory_limit", "output_limit", "compile_error", "sandbox_error"
]


class ExecuteRequest(Wire):
    """``POST /v1/execute``: run ``code`` in the sandbox."""

    language: Literal["python"] = "python"
    code: str = Field(min_length=1)
    stdin: str = ""
    files: dict[str, str] = Field(default_factory=dict, description="Relative path -> content, written to the work dir.")
    limits: Limits = Field(default_factory=Limits)


class ExecuteResult(Wire):
    status: ExecStatus
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float
    truncated: bool


# --------------------------------------------------------------------------
# Generation

FinishReason = Literal["stop", "length", "abort"]


Role = Literal["system", "user", "assistant"]


class Message(Wire):
    """One chat turn, OpenAI's shape (text content only)."""

    role: Role
    content: str


def _answerable(messages: list[Message]) -> list[Message]:
    if messages[-1].role != "user":
        raise ValueError(f"the last message must be the user's (the model answers it), not the {messages[-1].role}'s")
    return messages


Messages = Annotated[list[Message], Field(min_length=1), AfterValidator(_answerable)]
"""Chat turns a model answers: at least one, the last the user's. The rollout server renders them
with the model's own chat template (``services.prompt_forms``)."""

ChatTemplateKwargs = dict[str, str | bool | int | float]
"""Extra variables of a chat template (``prompt.chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``)."""


class GenerateRequest(Wire):
    """``POST /v1/generate``: exactly one of ``prompt``, ``prompt_token_ids`` and ``messages``
    (rendered with the model's chat template and ``chat_template_kwargs``)."""

    prompt: str | None = Field(default=None, min_length=1)
    prompt_token_ids: list[int] | None = Field(default=None, min_length=1)
    messages: Messages | None = None
    chat_template_kwargs: ChatTemplateKwargs = Field(default_factory=dict)
    n: int = Field(default=1, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=10)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0, description="0 = off.")
    max_tokens: int = Field(default=64, ge=1)
    stop: list[str] = Field(default_factory=list, max_length=16)
    seed: int | None = None
    episode: EpisodeSpec | None = Field(
        default=None, description="Set: each of the n samples is a multi-turn episode with these tools "
        "(held-out evaluation of episode lines); 422 naming episode.tools for a tool this server lacks.")

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if sum(x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)) != 1:
            raise ValueError("give exactly one of 'prompt', 'prompt_token_ids' and 'messages'")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        return self


class Sample(Wire):
    """One completion. ``logprobs[i]`` is the behaviour log-probability of ``token_ids[i]`` with the
    request's sampling parameters, under the policy that sampled it: ``policy_version``, or with
    ``token_versions`` (an in-flight reload fell inside the sample: ``publish.reload = "keep"``) the
    version of the span holding token ``i``; ``policy_version`` is then the oldest."""

    token_ids: TokenIds
    logprobs: LogProbs
    text: str
    finish_reason: FinishReason
    policy_version: int = Field(ge=0)
    token_versions: list[tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]]] = Field(
        default_factory=list, max_length=64,
        description="(first token index, version) of each weight version that sampled part of the completion, "
                    "in token order; empty when one version sampled it all (policy_version).")

    @model_validator(mode="after")
    def _aligned(self) -> Sample:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"logprobs has {len(self.logprobs)} entries for {len(self.token_ids)} token_ids"
            )
        starts = [i for i, _ in self.token_versions]
        if self.token_versions and (starts[0] != 0 or starts != sorted(set(starts)) or starts[-1] >= len(self.token_ids)):
            raise ValueError(f"token_versions {self.token_versions[:8]}: spans must start at 0, rise, and "
                             f"begin inside the {len(self.token_ids)} tokens")
        if self.token_versions and min(v for _, v in self.token_versions) != self.policy_version:
            raise ValueError(f"policy_version {self.policy_version} is not the oldest token's "
                             f"({min(v for _, v in self.token_versions)})")
        return self

    def versions(self) -> list[int]:
        """Every version that sampled a token of it, oldest first."""
        return sorted({self.policy_version, *(v for _, v in self.token_versions)})


LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
"""What behaviour log-probs are (the rollout engine's ``logprobs_mode``): ``processed_logprobs`` of the
distribution sampled from (after temperature, min_tokens, top-k, top-p), ``raw_logprobs`` the log-softmax
of the model's logits (temperature 1, nothing masked)."""


class GenerateResponse(Wire):
    prompt_token_ids: list[int]
    samples: list[Sample]
    logprobs_mode: LogprobsMode = Field(
        default="processed_logprobs",
        description="What samples[].logprobs are: 'processed_logprobs' = of the distribution sampled from "
        "(after temperature, min_tokens, top-k, top-p), 'raw_logprobs' = log-softmax of the model's logits "
        "(temperature 1).",
    )
    last_turns: list[str] | None = Field(
        default=None, description="With an episode: each sample's last turn of the model, the text a reward "
        "scores (samples[].text is the whole transcript, observations included).")


class LoadWeights(Wire):
    """``POST /v1/weights``: load ``version`` from ``uri``. Over HTTP ``sha256`` is required and the
    version must be one the run's registry published with that uri and checksum, under the weight
    store's root (``rollout_server.api``); the engine's own return to its base weights has none."""

    version: int = Field(ge=0)
    uri: str = Field(min_length=1)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class WeightsStatus(Wire):
    version: int
    uri: str | None
    reload_s: float | None = None


# --------------------------------------------------------------------------
# Stream payloads


def _one_form(value: PromptGroup | EvalPrompt) -> None:
    if (value.prompt is None) == (value.messages is None):
        raise ValueError("give exactly one of 'prompt' and 'messages'")


TOOL_NAME = r"^[a-z][a-z0-9_]{0,39}$"
"""A tool's name, as the model writes it in a call (``<tool>NAME: ARGS</tool>``, ``rollout_server.tools``)."""


class EpisodeSpec(Wire):
    """A prompt that is a multi-turn episode (``rollout_server.episodes``): the model writes, may call one of
    ``tools`` (``<tool>NAME: ARGS</tool>``), reads the tool's observation, and goes on, for at most
    ``max_turns`` turns of its own and ``max_tokens`` completion tokens in all (its own and the observations';
    None: the run's ``sampling.max_tokens``). Each call is bounded by ``tool_timeout_s``, the episode's calls
    together by ``tool_budget_s`` (None: the rollout server's); the server's own bounds
    (``TANDEM_ROLLOUT_TOOL_TIMEOUT_S``, ``TANDEM_ROLLOUT_TOOL_EPISODE_S``) cap both: a line lowers them, never
    raises them (``rollout_server.tools``)."""

    tools: list[Annotated[str, Field(pattern=TOOL_NAME)]] = Field(default_factory=list, max_length=32)
    max_turns: int = Field(default=4, ge=1, le=64)
    max_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    tool_timeout_s: float = Field(default=10.0, gt=0, le=600)
    tool_budget_s: float | None = Field(default=None, gt=0, le=86400)

    @model_validator(mode="after")
    def _distinct(self) -> EpisodeSpec:
        if len(set(self.tools)) != len(self.tools):
            raise ValueError("tools: each tool is named once")
        return self


class PromptGroup(Wire):
    """One entry of the ``prompts`` stream: generate ``n`` completions of ``prompt`` (text, tokenized as
    it is) or of ``messages`` (rendered with the model's chat template), score with ``spec``.

    Exactly one of ``prompt`` and ``messages``. ``group_id`` is unique within the run and stable
    across redeliveries.
    """

    run_id: str
    group_id: str = Field(min_length=1, max_length=128)
    prompt: str | None = Field(default=None, min_length=1)
    messages: Messages | None = None
    spec: RewardSpec
    n: int = Field(ge=1, le=1024)
    index: int = Field(default=0, ge=0, description="Line number in the prompt set.")
    epoch: int = Field(default=0, ge=0)
    episode: EpisodeSpec | None = Field(default=None, description="Set: each of the n samples is a multi-turn episode.")

    @model_validator(mode="after")
    def _form(self) -> PromptGroup:
        _one_form(self)
        return self


class EvalPrompt(Wire):
    """One held-out prompt of a run (the control plane stores them when the run is created;
    ``services.evaluate``): generated once, greedy unless ``eval.temperature > 0``, and correct
    when ``spec`` scores the completion 1. ``spec`` carries no format bonus. With ``episode`` (the line's)
    each completion is an episode with its tools, and ``spec`` scores the model's last turn, as in training."""

    prompt: str | None = Field(default=None, min_length=1)
    messages: Messages | None = None
    spec: RewardSpec
    episode: EpisodeSpec | None = Field(default=None, description="Set: each completion is a multi-turn episode.")

    @model_validator(mode="after")
    def _form(self) -> EvalPrompt:
        _one_form(self)
        return self


Logged = dict[Annotated[str, Field(min_length=1, max_length=100)], float | int | bool | str | None]
"""What python reward functions logged for one completion with ``log_extra``, by column."""


class ScoredSample(Sample):
    """A sample with its reward (never an infrastructure failure: those groups are not sent), the
    reward's named ``components``, if a python reward function gave any, and what reward functions logged for
    it with ``log_extra`` (``logged``: TRL's completions-table columns).

    An episode's sample (``PromptGroup.episode``) holds every completion token, the model's and the tools'
    observations', in order: ``mask[i]`` is 1 where the model generated ``token_ids[i]`` (trained) and 0 on
    an observation token (its ``logprobs`` entry is 0 and means nothing); empty = every token the model's.
    ``turn_versions[k]`` is the weight version that generated the model's turn k (``policy_version`` is
    the oldest); ``tool_calls`` calls were made, ``tool_errors`` of them answered with an error."""

    reward: float
    status: ScoreStatus
    components: Components = Field(default_factory=dict)
    logged: Logged = Field(default_factory=dict)
    mask: TokenMask = Field(default_factory=list)
    turns: int = Field(default=1, ge=1)
    turn_versions: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    tool_calls: int = Field(default=0, ge=0)
    tool_errors: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _scored(self) -> ScoredSample:
        if self.status in INFRA_STATUSES or not math.isfinite(self.reward):
            raise ValueError("trajectories carry only scored samples with finite rewards")
        if self.mask and len(self.mask) != len(self.token_ids):
            raise ValueError(f"mask has {len(self.mask)} entries for {len(self.token_ids)} token_ids")
        if self.turn_versions:
            if len(self.turn_versions) != self.turns:
                raise ValueError(f"turn_versions has {len(self.turn_versions)} entries for {self.turns} turns")
            if min(self.turn_versions) != self.policy_version:
                raise ValueError(f"policy_version {self.policy_version} is not the oldest turn's "
                                 f"({min(self.turn_versions)})")
        if self.tool_errors > self.tool_calls:
            raise ValueError(f"tool_errors {self.tool_errors} > tool_calls {self.tool_calls}")
        return self

    def versions(self) -> list[int]:
        """Every version that sampled a token of it (an episode's turns too), oldest first."""
        return sorted({*super().versions(), *self.turn_versions})


class TrajectoryGroup(Wire):
    """One entry of the ``trajectories`` stream: the scored samples of one prompt group.

    Invariants: ``len(samples) == n``; ``policy_version`` is the oldest
    version any sample was generated by (staleness is judged by it);
    every sample's logprobs align with its token ids. ``prompt`` is the text the model read (messages
    as the chat template rendered them). ``logprobs_mode`` is what the samples' log-probs are (the
    engine's that generated them); the learner refuses a group whose mode is not the distribution its
    run samples from (``SamplingConfig.logprobs_refusal``).
    """

    run_id: str
    group_id: str = Field(min_length=1, max_length=128)
    prompt: str
    prompt_token_ids: Annotated[TokenIds, Field(min_length=1)]
    samples: list[ScoredSample] = Field(min_length=1)
    n: int = Field(ge=1)
    policy_version: int = Field(ge=0)
    rollout_id: str = ""
    gen_s: float = Field(default=0.0, ge=0)
    logprobs_mode: LogprobsMode = "processed_logprobs"
    reward_metrics: dict[Annotated[str, Field(min_length=1, max_length=100)], float] = Field(
        default_factory=dict, max_length=32,
        description="What python reward functions logged with log_metric while scoring the group (the means, by "
                    "name: ScoreResponse.metrics); the learner logs each one's mean per step as fn_<name>.")

    @model_validator(mode="after")
    def _consistent(self) -> TrajectoryGroup:
        if not all(math.isfinite(v) for v in self.reward_metrics.values()):
            raise ValueError("reward_metrics must be finite")
        if len(self.samples) != self.n:
            raise ValueError(f"{len(self.samples)} samples for a group of n={self.n}")
        oldest = min(s.policy_version for s in self.samples)
        if self.policy_version != oldest:
            raise ValueError(f"policy_version {self.policy_version} is not the oldest sample's ({oldest})")
        return self


# --------------------------------------------------------------------------
# Runs and the control plane

class RunRecord(Wire):
    """One run in the registry (``services.runs.RunStore``).

    ``config`` is the validated ``RunConfig`` as JSON (``parse_run_config``
    accepts it back). ``started_at`` is set on entering ``running``,
    ``finished_at`` on entering a terminal state; ``error`` is non-empty only
    for ``failed``. ``step`` and ``policy_version`` are the learner's.
    """

    run_id: str
    state: RunState
    prompt_set_id: str
    config: dict
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    error: str = ""
    step: int = Field(default=0, ge=0)
    policy_version: int = Field(default=0, ge=0)


class MetricPoint(Wire):
    """One entry of a run's metrics stream: ``values`` measured by ``source`` at learner ``step``.

    ``id`` is the Redis stream id (time-ordered; pass it as ``since`` to read
    only newer points); ``t`` is Unix time; every value is finite.
    """

    id: str
    t: float
    source: str
    step: int = Field(ge=0)
    values: dict[str, float]


class CompletionRow(Wire):
    """One row of a run's completions table (``services.runs.CompletionsLog``; TRL's ``log_completions``): a sample
    the learner trained at ``step``, its reward, and the columns python reward functions logged for it with
    ``log_extra``."""

    id: str = Field(description="The row's stream id (pass the last as the next page's `since`).")
    step: int = Field(ge=0)
    version: int = Field(ge=0, description="The policy version that generated it.")
    group_id: str
    prompt: str
    completion: str
    reward: float
    advantage: float
    logged: Logged = Field(default_factory=dict)


class CompletionsPage(Wire):
    """``GET /v1/runs/{id}/completions``: rows after ``since``, oldest first; ``next`` = last id read."""

    run_id: str
    rows: list[CompletionRow]
    next: str | None


class MetricsPage(Wire):
    """``GET /v1/runs/{id}/metrics``: points after ``since``, oldest first; ``next`` = last id read."""

    run_id: str
    points: list[MetricPoint]
    next: str | None


class PromptSetInfo(Wire):
    """A stored prompt set: ``count`` lines, ``reward_types`` = lines per reward type
    (``"default"`` for lines that name none and take the run config's)."""

    id: str
    count: int = Field(ge=1)
    bytes: int = Field(ge=0)
    created_at: float
    reward_types: dict[str, int]
    forms: dict[str, int] = Field(default_factory=dict)
    """Lines per prompt form: ``prompt``, ``messages``, ``template`` (fields a run's ``prompt.template`` fills
    in); empty for sets stored before forms were counted."""


class CreateRun(Wire):
    """``POST /v1/runs``: ``config`` is a RunConfig as JSON; omitted = the control plane's own. Its
    ``model.path`` must be a folder the control plane sees, directly or mapped from ``client_run_dir``
    (else 422 naming ``model.path``); the run stores the path the control plane found.

    ``eval_prompt_set_id``: a stored prompt set of held-out prompts, evaluated on the rollout servers
    at version 0 (``eval.before``) and every ``eval.every`` published versions; required when
    ``eval.every > 0``."""

    prompt_set_id: str = Field(min_length=1, max_length=64)
    config: dict | None = None
    eval_prompt_set_id: str | None = Field(default=None, min_length=1, max_length=64)
    client_run_dir: str | None = Field(default=None, max_length=4096, description=(
        "The submitting machine's run directory (absolute), which the deployment's run directory mirrors: "
        "a model.path under it that the control plane cannot see is looked for at the same place under its "
        "own run directory (control_plane.model_path)."))


class RunCreated(Wire):
    run_id: str
    groups: int = Field(ge=0, description="Prompt groups enqueued (epochs x prompt-set lines).")


class Staleness(Wire):
    max_staleness: int = Field(description="eta, the run's bound.")
    max_observed_lag: float | None = Field(description="Largest v_learner - v of a trained group so far.")
    stale_dropped: int
    queued: int = Field(description="Groups generated and waiting for the learner.")
    in_flight: int = Field(description="Groups admitted and being generated.")
    backlog: int = Field(description="Prompt groups not yet taken by a rollout server.")


class Throughput(Wire):
    rollout_tokens_per_s: float | None
    learner_tokens_per_s: float | None
    rollout_idle_frac: float | None
    learner_idle_frac: float | None


class ServiceCpu(Wire):
    cpu_s: float = Field(ge=0, description="CPU-seconds its processes used since the run started.")
    per_sample_s: float | None = Field(default=None, description="cpu_s per trained sample (None before any).")
    processes: dict[str, float] = Field(
        default_factory=dict, description="cpu_s by process name (python, VLLM::EngineCor, runsc-sandbox, ...).")


class CpuAccount(Wire):
    """Where a run's CPU went, per service: measured from ``/proc`` by the stack that runs the services
    (``tandem run``, ``tandem up``: ``deploy.cpu_account``) every few seconds, from the moment it first saw
    the run; absent for services it does not run (a deployment without a stack). ``stack`` is the
    supervising process itself (``tandem run`` with its progress line, or ``tandem up``)."""

    at: float = Field(description="Unix time of the reading.")
    services: dict[str, ServiceCpu]
    samples_trained: int = Field(default=0, ge=0, description="Trained groups times the group size, then.")
    per_sample_s: float | None = Field(default=None, description="Every service's CPU per trained sample.")

    def per_sample(self, samples_trained: int) -> CpuAccount:
        """The account with its per-sample figures for ``samples_trained``."""
        per = (lambda s: s / samples_trained) if samples_trained else (lambda s: None)
        return self.model_copy(update={
            "samples_trained": samples_trained,
            "per_sample_s": per(sum(c.cpu_s for c in self.services.values())),
            "services": {n: c.model_copy(update={"per_sample_s": per(c.cpu_s)}) for n, c in self.services.items()}})


class Incident(Wire):
    """A watchdog fired (``services.watchdog``): ``what`` waited ``waited_s`` on ``on``, past
    ``limit_s`` (the run config's ``field``), and ``action`` is what was done about it.

    Written by the process that waited (rollout server, learner rank) to the run's incidents
    stream; ``GET /v1/runs/{id}`` returns the newest. ``stack`` is the waiting thread's or
    task's stack when it fired (truncated)."""

    at: float = Field(description="Unix time the watchdog fired.")
    source: str = Field(max_length=200, description="Who waited: 'rollout:<server id>', 'learner:rank<r>'.")
    what: str = Field(max_length=500)
    on: str = Field(max_length=500, description="What it was waiting on.")
    waited_s: float = Field(ge=0)
    limit_s: float | None = Field(default=None, ge=0, description="The bound in seconds; None for a bound that "
                                                                  "is not a time (reward.fail_after: a count).")
    field: str = Field(max_length=100, description="The config field that sets the bound, e.g. watchdog.reload_s.")
    action: str = Field(max_length=500, description="What was done: refused and retried, group redelivered, "
                                                    "service exits for a restart, run failed.")
    stack: str = Field(default="", max_length=20_000)


class EvalPoint(Wire):
    """Held-out accuracy of one policy version: every one of the ``count`` prompts' ``samples``
    completions was generated by ``version`` (``services.evaluate``). With one (greedy) sample,
    ``accuracy`` is the fraction of prompts answered correctly; with more it is mean@samples and
    ``pass_at`` maps k to pass@k (Chen et al.'s unbiased estimator)."""

    version: int = Field(ge=0)
    accuracy: float = Field(ge=0, le=1)
    count: int = Field(ge=0)
    samples: int = Field(default=1, ge=1)
    pass_at: dict[int, Annotated[float, Field(ge=0, le=1)]] = Field(default_factory=dict)
    reward_mean: float | None = Field(
        default=None, allow_inf_nan=False,
        description="Mean reward of the held-out completions scored: the held-out score of a reward that is not "
                    "0 or 1 (a reward model, partial credit), where accuracy counts the completions rewarded 1.")
    by: str = Field(default="", max_length=200, description="Who evaluated it: a rollout server's id, or 'tandem-run'.")


class RunStatus(Wire):
    """``GET /v1/runs/{id}``: the record plus the latest metrics and the broker's accounting."""

    run: RunRecord
    reward_mean: float | None
    accuracy: float | None = Field(description="Latest held-out accuracy (0..1).")
    accuracy_first: float | None = Field(description="First held-out accuracy measured (before training).")
    eval: EvalPoint | None = Field(default=None, description="The newest policy version evaluated so far.")
    weights_version: int | None = Field(description="Newest published weight version.")
    staleness: Staleness
    throughput: Throughput
    counters: dict[str, int]
    incidents: list[Incident] = Field(
        default_factory=list, description="The newest watchdog incidents of the run, newest first.")
    cpu: CpuAccount | None = Field(default=None, description="CPU per service and per trained sample, where a "
                                                             "stack runs the services.")

    def dropped(self) -> dict[str, int]:
        """Groups dropped so far, by reason (:func:`dropped_by_reason`)."""
        return dropped_by_reason(self.counters)


def dropped_by_reason(counters: dict[str, int]) -> dict[str, int]:
    """Groups dropped, by reason, from a run's counters: the learner's (``<reason>_dropped``: ``stale``,
    ``zero_variance``, ``empty``) and the rollout side's dead letters, those whose scoring failed
    (``infra_dropped``: a reward function that raised, a judge or sandbox that errored) apart from the rest
    (``dead_lettered``: lines that cannot be generated, refused by the reward server, delivered too often)."""
    out = {name.removesuffix("_dropped"): n for name, n in counters.items() if name.endswith("_dropped") and n}
    if (other := counters.get("dead_lettered", 0) - counters.get("infra_dropped", 0)) > 0:
        out["dead_lettered"] = other
    return out


def dropped_text(dropped: dict[str, int]) -> str:
    """``12 (infra 4, stale 8)``: groups dropped in all, then by reason (:func:`dropped_by_reason`)."""
    reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(dropped.items()))
    return f"{sum(dropped.values())}" + (f" ({reasons})" if reasons else "")


# --------------------------------------------------------------------------
# Encoding

M = TypeVar("M", bound=BaseModel)


def encode(model: BaseModel) -> bytes:
    """Compact binary form of a wire model (msgpack)."""
    return msgpack.packb(model.model_dump(mode="python", exclude_defaults=False), use_bin_type=True)


def decode(cls: type[M], data: bytes) -> M:
    """Parse and validate bytes made by :func:`encode`; raises ``ValueError`` on bad input."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as e:
        raise ValueError(f"not a msgpack payload: {e}") from e
    return cls.model_validate(raw)


async def decode_delivery(stream: Stream, delivery: Delivery, cls: type[M]) -> M | None:
    """The delivery's payload as ``cls``, or None after dead-lettering it with the reason.

    Consumers use this so one malformed entry never stops them.
    """
    try:
        return decode(cls, delivery.envelope.payload)
    except ValueError as e:
        await stream.dead_letter(delivery, f"invalid {cls.__name__}: {e}"[:2000])
        return None
