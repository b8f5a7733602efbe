"""The run config: one TOML file, validated by pydantic, loud about mistakes.

Every field is documented where it is declared. Unknown keys are errors
(``extra="forbid"``), cross-field constraints are checked at load time, and
:func:`load_run_config` names the file and the dotted field in its error:

    examples/arith/run.toml: loss.eps_hihg: unknown field

Service settings (ports, URLs, tokens) are not here: they come from
``TANDEM_*`` environment variables (``services.settings``).
"""

from __future__ import annotations

import difflib
import string
import tomllib
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from broker.keys import check_run_id
from services.reward_specs import RewardType

MAX_EPOCHS = 1000
"""Most passes a run config may ask for over its prompt set (``data.epochs``)."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ModelConfig(Section):
    path: Path
    """Local Hugging Face model directory (config.json, weights, tokenizer) of the initial policy."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype in the rollout engine."""
    max_model_len: int = Field(default=512, ge=16)
    """Longest prompt + completion, in tokens."""
    bootstrap: Literal["arith", "tool_arith", "judge_arith"] | None = None
    """If set and ``path`` holds no model yet, ``tandem run`` builds this example model there first
    (``examples/<name>/bootstrap.py``, from ``data.train``)."""


class DataConfig(Section):
    train: Path
    """Prompt set to train on (JSON lines: ``prompt``, ``messages`` or the fields ``prompt.template`` fills in,
    plus reward-spec fields; ``services.prompt_lines``)."""
    eval: Path | None = None
    """Held-out prompt set for evaluation before, during (``eval.every``) and after training (same format)."""
    epochs: int = Field(default=1, ge=1, le=MAX_EPOCHS)
    """Passes over the training prompt set (at most 1000: a run enqueues epochs x lines prompt
    groups when it starts)."""
    shuffle_seed: int | None = 0
    """Seed of the per-epoch shuffle; None keeps file order."""


CHAT_TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})
"""Arguments of ``apply_chat_template`` itself, which ``prompt.chat_template_kwargs`` may not set."""


def template_fields(template: str) -> list[str]:
    """The placeholder names of a prompt template, in order of first use. Raises ``ValueError`` for
    anything but plain ``{name}`` placeholders (no ``{}``, ``{0}``, ``{a.b}``, ``{a[0]}``, ``{a!r}``,
    ``{a:>5}``): a template fills in text, it does not reach into objects."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"not a valid template: {e} (a literal brace is written {{{{ or }}}})") from None
    names: list[str] = []
    for _text, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise ValueError(f"placeholder {{{name}}}: name a line field, e.g. {{question}}")
        if spec or conversion:
            raise ValueError(f"placeholder of {name!r}: write it as plain {{{name}}} (no conversion or format spec)")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("the template has no {field} placeholder: it would give every line the same prompt")
    return names


class PromptConfig(Section):
    """How a prompt-set line becomes what the model reads (``services.prompt_forms``). Lines carry ``prompt``
    text, chat ``messages`` (rendered by the rollout server with the model's own chat template), or
    named fields that ``template`` turns into text. Checked against every line when the run is
    created: a problem is a 422 naming the line and field."""

    system_prompt: str | None = Field(default=None, min_length=1)
    """A system turn put first: in messages lines that have no system turn of their own (theirs wins),
    and in prompt and template lines, which then become ``[system, user: <their text>]`` and are
    rendered with the chat template too. Needs a model with a chat template; for a base model, write
    the instructions into ``template``."""
    template: str | None = None
    """Text template for prompt and template lines (base models), e.g. ``"Question: {question}\nAnswer:"``:
    each ``{name}`` is filled with the line's field of that name (``{prompt}`` is a prompt line's text).
    Every placeholder must be a field of each line and each of a line's fields must be used; reward-spec
    fields (the answer) are never available. Messages lines are not templated."""
    chat_template_kwargs: dict[str, str | bool | int | float] = Field(default_factory=dict)
    """Extra variables for the chat template of messages lines, passed to
    ``tokenizer.apply_chat_template`` (e.g. ``{enable_thinking = false}`` for Qwen3)."""

    @field_validator("template")
    @classmethod
    def _placeholders(cls, value: str | None) -> str | None:
        if value is not None:
            template_fields(value)
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_arguments(cls, value: dict) -> dict:
        taken = sorted(set(value) & CHAT_TEMPLATE_ARGUMENTS)
        if taken:
            raise ValueError(f"{taken[0]!r} is an argument of apply_chat_template itself, not a template variable")
        return value


class SamplingConfig(Section):
    group_size: int = Field(default=8, ge=2, le=1024)
    """G: completions sampled per prompt (GRPO needs at least 2 to compare)."""
    temperature: float = Field(default=1.0, gt=0, le=10)
    """Sampling temperature for training rollouts."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass (1 = off)."""
    top_k: int = Field(default=0, ge=0)
    """Top-k sampling (0 = off)."""
    max_tokens: int = Field(default=64, ge=1)
    """Completion length cap in tokens."""
    min_tokens: int = Field(default=0, ge=0)
    """Completion tokens sampled before EOS or a stop string may end a completion (vLLM's ``min_tokens``; 0 = off).
    An episode counts the model's tokens over all its turns; a tool call may end a turn before. The learner
    masks the end-of-sequence tokens at these positions too, as the sampler did (``learner.logits``)."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings (the stop string is kept out of the completion)."""

    def logprobs_refusal(self, mode: str) -> str | None:
        """Why behaviour log-probs of ``mode`` (a rollout engine's ``logprobs_mode``) cannot train a run
        sampled with these settings, or None. The importance ratio needs the log-probs of the distribution
        the tokens were drawn from; ``raw_logprobs`` (the log-softmax of the logits) is that distribution
        only when nothing processes the logits: temperature 1, no top-k, top-p or min_tokens."""
        if mode == "processed_logprobs":
            return None
        processed = [f"{name} = {value}" for name, value, off in (
            ("temperature", self.temperature, 1.0), ("top_k", self.top_k, 0), ("top_p", self.top_p, 1.0),
            ("min_tokens", self.min_tokens, 0)) if value != off]
        if mode == "raw_logprobs" and not processed:
            return None
        if mode != "raw_logprobs":
            return f"log-probs of an unknown mode {mode!r}"
        return (f"the rollout engine records raw_logprobs (the temperature-1 distribution), but the run samples "
                f"with sampling.{', sampling.'.join(processed)}: start the rollout server with "
                "TANDEM_ROLLOUT_LOGPROBS_MODE=processed_logprobs")


class RewardConfig(Section):
    type: RewardType = "math"
    """Default reward type for prompt-set lines that do not name one."""
    extract: Literal["answer_tag", "boxed", "last_number", "whole"] = "answer_tag"
    """Default answer extraction for math/exact/numeric specs."""
    format_weight: float = Field(default=0.0, ge=0)
    """If > 0, add this weight times a format reward (the answer tag is present)."""
    retries: int = Field(default=2, ge=0)
    """Times a group whose scoring hit an infrastructure failure is retried before it is dropped."""
    fail_after: int = Field(default=8, ge=0)
    """Groups in a row that one rollout server drops because their scoring failed (a python reward function
    that raised, a judge or sandbox that errored, each after ``retries``; a request the reward server
    refused, such as a reward model it does not list) before the run fails, with that
    error (``tandem run``, ``tandem status``, the dashboard, an incident); a group scored in between starts
    the count again, so sporadic failures are dropped and counted, and never stop the run. 0: never."""


class LoraConfig(Section):
    r: int = Field(default=8, ge=1)
    """LoRA rank."""
    alpha: float = Field(default=16.0, gt=0)
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the LoRA input."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names to adapt. Not the head or the input embedding of a model whose head is tied to them
    (``tie_word_embeddings``): the learner refuses them at start (vLLM serves one tensor as both)."""


class LossConfig(Section):
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """Group-relative baseline: mean/std (GRPO), mean only (Dr. GRPO), leave-one-out (RLOO)."""
    filter_zero_variance: bool = True
    """Drop groups whose rewards are all equal (DAPO dynamic sampling): they carry no signal."""
    policy_loss: Literal["ppo_clip", "gspo"] = "ppo_clip"
    """Token-level PPO clip, or GSPO's sequence-level ratio."""
    eps_low: float = Field(default=0.2, ge=0, le=1)
    """Lower clip range: ratio >= 1 - eps_low."""
    eps_high: float = Field(default=0.28, ge=0, le=10)
    """Upper clip range: ratio <= 1 + eps_high (DAPO clip-higher when > eps_low)."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "token_sum_norm"] = "token_mean"
    """How token losses become one number: over all tokens (DAPO), per sequence then over
    sequences (GRPO paper), or summed and divided by ``norm_tokens`` (Dr. GRPO)."""
    norm_tokens: int | None = None
    """Constant divisor for ``token_sum_norm`` (default: sampling.max_tokens x batch sequences)."""
    beta: float = Field(default=0.0, ge=0)
    """KL coefficient to the frozen reference policy (0 = no reference model)."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """KL estimator (Schulman's k1 or k3)."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Entropy bonus coefficient."""
    off_policy: Literal["none", "tis", "decoupled"] = "tis"
    """Correction for stale samples: none, truncated importance sampling against the behaviour
    log-probs, or the decoupled PPO objective (proximal = weights at batch start)."""
    tis_cap: float = Field(default=2.0, ge=1)
    """Cap C of the truncated importance weight min(pi_prox / pi_behav, C)."""
    drop_overlong: bool = False
    """Mask completions cut at max_tokens (overlong filtering, DAPO)."""


class LearnerConfig(Section):
    zero_stage: Literal[0, 1, 2, 3] = 2
    """DeepSpeed ZeRO stage."""
    offload_optimizer: bool = False
    """ZeRO-Offload of optimizer state to CPU memory (stage >= 1)."""
    offload_params: bool = False
    """ZeRO-3 parameter offload to CPU memory."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Training precision."""
    lr: float = Field(default=1e-5, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(default=1.0, ge=0)
    """Gradient-norm clip (0 = off)."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear learning-rate warm-up."""
    groups_per_step: int = Field(default=8, ge=1)
    """Prompt groups per optimizer step (batch = groups_per_step x group_size sequences)."""
    micro_batch_tokens: int = Field(default=8192, ge=64)
    """Token budget of one micro-batch (sequences are packed up to it; gradients accumulate). A
    sequence longer than the budget gets a micro-batch of its own."""
    packing: bool = True
    """Padding-free micro-batches: a micro-batch's sequences are concatenated into one row with
    per-sequence position ids and attention that stays within each sequence (``learner.packing``),
    so no compute goes to padding. ``false``: one right-padded row per sequence, micro-batches
    bucketed by length. A model whose attention does not honour the packing falls back to
    padding at start-up, with a warning."""
    logit_chunk_tokens: int = Field(default=1024, ge=1)
    """Log-probs and entropy are computed from the final hidden states this many completion
    tokens at a time, each chunk recomputed in the backward pass (``learner.logits``): the
    learner never holds more than this many tokens' fp32 logits (``tokens x vocabulary``)."""
    gradient_checkpointing: bool = False
    """Activation checkpointing."""
    steps: int = Field(default=100, ge=1)
    """Optimizer steps to train."""
    seed: int = 0
    """Seed for torch and the data order."""
    checkpoint_every: int = Field(default=50, ge=0)
    """Save a resumable checkpoint every N steps (0 = no step cadence). A crash loses at most the
    steps since the last checkpoint; their groups are trained again (never lost, never twice)."""
    checkpoint_every_s: float = Field(default=600.0, ge=0)
    """Also save one when this many seconds passed since the last (0 = no time cadence)."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter instead of all weights (published as ``publish.lora_format`` says)."""
    wait_timeout_s: float = Field(default=600.0, gt=0)
    """Give up (fail the run) when no trajectory arrives for this long."""


class StalenessConfig(Section):
    max_staleness: int = Field(default=1, ge=0)
    """eta: a group generated by version v trains the step producing v_learner+1 only if
    v_learner - v <= eta. 0 = strictly on-policy."""
    lease_s: float = Field(default=300.0, gt=0)
    """How long a rollout server may hold an admitted group before its slot is reclaimed."""
    visibility_timeout_s: float = Field(default=300.0, gt=0)
    """An entry pending this long without an ack is redelivered to another consumer."""
    max_deliveries: int = Field(default=5, ge=1)
    """Deliveries after which an entry goes to the dead-letter stream."""


class PublishConfig(Section):
    every: int = Field(default=1, ge=1)
    """Publish a new weight version every N optimizer steps."""
    keep: int = Field(default=3, ge=1)
    """Versions kept on disk (older ones are deleted once no rollout server uses them)."""
    keep_every: int = Field(default=0, ge=0)
    """Also keep every version whose number is a multiple of N, for good (0 = none): snapshots
    that outlive the rolling window of ``keep``, for ``tandem export RUN --version N``."""
    keep_best: int = Field(default=0, ge=0)
    """Also keep the N versions with the highest held-out score (``eval.every``'s accuracy; a tie
    keeps the newer), and any version due for evaluation until it is scored (0 = none); see
    ``learner.retention.retained``. ``tandem export RUN --version best`` exports the best of them."""
    lora_format: Literal["merged", "adapter"] = "merged"
    """With ``learner.lora``: publish full weights with the adapter merged in (what vLLM's in-place
    ``reload_weights`` loads), or only the adapter in PEFT format (``adapter_model.safetensors`` +
    ``adapter_config.json``; far fewer bytes: MBs, not the model). The rollout server then starts vLLM with
    LoRA for rank ``learner.lora.r`` and serves each version as an adapter on the base weights
    (``rollout_server.adapters``)."""
    transport: Literal["files", "broadcast"] = "files"
    """How a version reaches the rollout servers. ``"files"``: written to the run directory, registered,
    and re-read by each server. ``"broadcast"``: the learner's rank 0 also streams the tensors in memory
    to the servers that joined the run's weight group (torch.distributed: gloo on CPU), each server
    swapping them in as it would a file and checking the learner's digest first (``services.weightgroup``);
    the files are still written, for resume, export and servers that could not join. Needs a network path
    from every rollout server to the learner (not across Modal apps: keep ``"files"`` there)."""
    reload: Literal["wait", "keep"] = "keep"
    """What a rollout server does with the requests in its engine when it loads a new version. ``"wait"``:
    they finish on the old weights first (the reload waits for the longest). ``"keep"`` (the default: faster
    in ``bench/e2e.py`` at every size measured, the same accuracy; docs/performance.md): in-flight updates
    (PipelineRL, AReaL): vLLM freezes them, the new weights go in, and they go on with the new weights, their
    KV cache recomputed; a sample may then span versions (``Sample.token_versions``), each token keeping the
    log-probability of the version that sampled it, and the sample counts as its oldest token's version for
    ``staleness.max_staleness`` (``rollout_server.reload``). An engine serving LoRA adapters always waits."""
    broadcast_timeout_s: float = Field(default=60.0, gt=0)
    """With ``transport = "broadcast"``: the longest the learner waits for the servers it announced a
    version to (to join the group, and for each bucket); past it the broadcast is abandoned, the servers
    in it are dropped from the group until they join again, and they catch up from the version's files."""


class EvalConfig(Section):
    """Held-out accuracy on ``data.eval`` (``services.evaluate``). A rollout server evaluates a version
    right after loading it, all prompts batched with the training generation, and loads no other
    version meanwhile, so each point measures exactly one policy version; the points are the run's
    ``"eval"`` metric (step = version) in ``tandem status``, the dashboard and the report."""

    before: bool = True
    """Evaluate version 0 (the initial policy) when the run starts, while the learner starts up."""
    after: bool = True
    """Evaluate the final version after training, whoever started the run (the learner asks the rollout
    servers for it and marks the run finished once it is recorded)."""
    every: int = Field(default=0, ge=0)
    """Also evaluate every N published versions (0 = never during training). Needs a held-out
    prompt set with the run (``tandem run`` and ``tandem submit`` upload ``data.eval``)."""
    max_prompts: int | None = Field(default=None, ge=1)
    """Evaluate on at most this many held-out prompts."""
    temperature: float = Field(default=0.0, ge=0)
    """0 = greedy decoding."""
    samples: int = Field(default=1, ge=1, le=1024)
    """Completions per held-out prompt. 1 (the default): accuracy is the fraction of prompts answered
    correctly. n > 1 (needs ``temperature > 0``): accuracy is mean@n, the fraction of all completions
    that are correct, and pass@k is reported for k = 1, 2, 4, ... below n and n itself (Chen et al.'s
    unbiased estimator; ``services.evaluate``)."""

    @model_validator(mode="after")
    def _sampled(self) -> EvalConfig:
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(f"samples = {self.samples} needs temperature > 0: greedy decoding gives "
                             "the same completion every time")
        return self


class WatchdogConfig(Section):
    """Bounds on every wait that could otherwise stall a run silently (``services.watchdog``).

    A wait past its bound is logged with what waited on what and the waiting stack, recorded as
    an incident of the run (``tandem status``, the dashboard), and handled as each field says.
    The sixth bound, on a learner that receives nothing, is ``learner.wait_timeout_s``."""

    reload_s: float = Field(default=120.0, gt=0)
    """A rollout server's weight reload: reading and verifying a version longer than this refuses
    it (old weights keep serving; the actor retries later); the in-place load itself running
    longer means the engine is stuck: the server turns unhealthy and exits to be restarted."""
    generate_s: float = Field(default=600.0, gt=0)
    """One generate call (a group's G samples; also how long a reload waits for requests in
    flight to drain). Past it the request is aborted and the group left for redelivery; if the
    engine then fails a one-token probe, the server exits to be restarted."""
    score_s: float = Field(default=300.0, gt=0)
    """One reward-server scoring call, all the client's attempts together; past it the actor
    leaves the group for redelivery (``TANDEM_ROLLOUT_SCORE_TIMEOUT_S`` bounds each attempt)."""
    step_s: float = Field(default=1800.0, gt=0)
    """One learner optimizer step, publish gather or checkpoint save on a rank. A thread stuck in
    DeepSpeed cannot be interrupted: past this the rank logs its stack and exits non-zero, so the
    supervisor restarts the learner (it resumes from its last checkpoint)."""
    collective_s: float = Field(default=900.0, gt=0)
    """torch.distributed's process-group timeout: a collective between learner ranks (an
    all-reduce, the command broadcast) waiting longer fails the run with an error naming it."""
    stall_s: float = Field(default=30.0, gt=0)
    """A service's heartbeat (``services.timeline``: every 0.5 s, from a thread of its own) silent
    longer than this is a stall its process could not see itself (stopped, frozen, swapped out):
    the control plane records it as an incident and a ``stalled`` span once it beats again, or
    when the run ends (``control_plane.stalls``). Training goes on; nothing is restarted."""


class LoggingConfig(Section):
    """Experiment trackers. The control plane follows the run's metrics stream and logs the run
    config as hyperparameters and every metric point (learner, rollout servers, held-out
    evaluation) to each tracker named here, through the tracker's own library (the trackers extra:
    ``make extras``); see ``control_plane.trackers``. A tracker that cannot start fails the
    run's creation (``POST /v1/runs`` answers 422 naming it); one that fails later is reported as
    an incident of the run and dropped, and training goes on."""

    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=list)
    """Trackers to log to (none by default)."""
    dir: Path | None = None
    """Where the trackers' local files go: TensorBoard's event files, W&B's run files, MLflow's
    file store. Default ``<run dir>/<run id>/trackers``; a relative path is taken from the
    control plane's run directory, and the path must stay under it (else ``POST /v1/runs`` answers 422)."""
    project: str | None = None
    """W&B project and MLflow experiment name (default: the run config's ``name``)."""
    wandb_entity: str | None = None
    """W&B entity (team or user; default: the API key's)."""
    wandb_mode: Literal["online", "offline"] | None = None
    """W&B mode (default: ``WANDB_MODE`` in the control plane's environment, else W&B's own)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI: one of the control plane's ``TANDEM_CONTROL_MLFLOW_TRACKING_URIS`` (else
    ``POST /v1/runs`` answers 422). Default: an SQLite store under ``dir``, ``<dir>/mlflow.db``."""
    completions: int = Field(default=4, ge=0, le=256)
    """Rows of the run's completions table per learner step (TRL's ``log_completions``): trained samples, one of
    each group in turn, with the step, prompt, completion, reward, advantage and every column python reward
    functions logged for them with ``log_extra``. In ``GET /v1/runs/{id}/completions``, the dashboard, the
    trackers (a TensorBoard text table, a W&B Table, MLflow's ``completions.json``) and ``tandem run``'s
    ``completions.jsonl``; the newest :data:`services.runs.COMPLETIONS_KEPT` rows are kept. 0: none."""
    close_after_s: float = Field(default=300.0, ge=0)
    """A run that ended keeps its trackers open this long after its last metric point (the main
    job's final evaluation comes after the learner finishes), or until another run starts or the
    control plane stops."""

    @model_validator(mode="after")
    def _distinct(self) -> LoggingConfig:
        if len(set(self.trackers)) != len(self.trackers):
            raise ValueError(f"trackers: {self.trackers} names a tracker twice")
        return self


class RunConfig(Section):
    """One training run."""

    name: str = "run"
    """Human-readable name; the run id is derived from it."""
    model: ModelConfig
    """The policy to train."""
    data: DataConfig
    """Training and held-out prompt sets."""
    prompt: PromptConfig = PromptConfig()
    """System prompt, text template and chat-template variables: how lines become prompts."""
    sampling: SamplingConfig = SamplingConfig()
    """How rollouts sample (G, temperature, lengths)."""
    reward: RewardConfig = RewardConfig()
    """Default reward spec and scoring retries."""
    loss: LossConfig = LossConfig()
    """The GRPO objective and its options."""
    learner: LearnerConfig = LearnerConfig()
    """DeepSpeed engine, optimizer and batch sizes."""
    staleness: StalenessConfig = StalenessConfig()
    """The staleness bound and delivery timeouts."""
    publish: PublishConfig = PublishConfig()
    """Weight publishing cadence and retention."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation."""
    watchdog: WatchdogConfig = WatchdogConfig()
    """Bounds on reloads, generate and score calls, learner steps and collectives."""
    logging: LoggingConfig = LoggingConfig()
    """Experiment trackers (TensorBoard, Weights & Biases, MLflow) the run's metrics go to."""

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        check_run_id(self.name)
        if self.staleness.max_staleness == 0 and self.publish.every != 1:
            raise ValueError(
                "staleness.max_staleness = 0 (on-policy) needs publish.every = 1: "
                "otherwise samples of the last published version are older than the weights they train"
            )
        if self.sampling.max_tokens >= self.model.max_model_len:
            raise ValueError(
                f"sampling.max_tokens ({self.sampling.max_tokens}) must be below "
                f"model.max_model_len ({self.model.max_model_len}) to leave room for the prompt"
            )
        if self.sampling.min_tokens > self.sampling.max_tokens:
            raise ValueError(f"sampling.min_tokens ({self.sampling.min_tokens}) must be <= "
                             f"sampling.max_tokens ({self.sampling.max_tokens})")
        if self.loss.eps_high < self.loss.eps_low and self.loss.policy_loss == "ppo_clip":
            raise ValueError("loss.eps_high must be >= loss.eps_low (clip-higher widens the upper side)")
        if self.learner.offload_params and self.learner.zero_stage != 3:
            raise ValueError("learner.offload_params needs learner.zero_stage = 3")
        if self.learner.offload_optimizer and self.learner.zero_stage == 0:
            raise ValueError("learner.offload_optimizer needs learner.zero_stage >= 1")
        if self.publish.transport == "broadcast" and self.learner.lora is not None \
                and self.publish.lora_format == "adapter":
            raise ValueError("publish.transport = 'broadcast' streams full weights: use publish.lora_format = "
                             "'merged' with it, or transport = 'files' for adapters")
        if self.publish.lora_format == "adapter" and self.learner.lora is None:
            raise ValueError("publish.lora_format = 'adapter' needs a [learner.lora] section")
        if self.publish.keep_best and not self.eval.every:
            raise ValueError("publish.keep_best needs eval.every > 0: versions are ranked by their held-out scores")
        if self.watchdog.collective_s <= self.learner.wait_timeout_s:
            raise ValueError(
                f"watchdog.collective_s ({self.watchdog.collective_s:g}) must be above learner.wait_timeout_s "
                f"({self.learner.wait_timeout_s:g}): ranks > 0 wait in a broadcast while rank 0 waits for data"
            )
        if self.watchdog.collective_s > self.watchdog.step_s:
            raise ValueError(
                f"watchdog.collective_s ({self.watchdog.collective_s:g}) must be at most watchdog.step_s "
                f"({self.watchdog.step_s:g}), so that a stuck rank fails the collective that waits on it, "
                "with its name, before the step watchdog ends the process"
            )
        return self

    def resolve_paths(self, base: Path) -> RunConfig:
        """Paths in the file are relative to the file's folder; return them made absolute."""
        def fix(p: Path | None) -> Path | None:
            return None if p is None or p.is_absolute() else (base / p).resolve()

        model = self.model.model_copy(update={"path": fix(self.model.path) or self.model.path})
        data = self.data.model_copy(
            update={"train": fix(self.data.train) or self.data.train, "eval": fix(self.data.eval) or self.data.eval}
        )
        return self.model_copy(update={"model": model, "data": data})


class ConfigError(ValueError):
    """A run's files cannot be used as they are: the run config, or a file it names (a prompt set that is
    missing, or whose lines do not fit the config). The user's mistake, not a bug: the message names the
    file and what to change, a line per mistake, and ``tandem run`` prints it without a traceback (exit 2)."""


def format_validation_error(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = _unknown_field(err["loc"]) if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"{source}: {field}: {msg}")
    return "\n".join(lines)


def _unknown_field(loc: tuple) -> str:
    """What to do about a field the run config does not have: the name of its section's field it is
    closest to (a misspelling), else that section's fields."""
    model: type[BaseModel] | None = RunConfig
    for key in loc[:-1]:
        field = model.model_fields.get(str(key))
        kinds = (get_args(field.annotation) or (field.annotation,)) if field is not None else ()
        model = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
        if model is None:
            return "unknown field"
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    if close:
        return f"unknown field; did you mean {close[0]}?"
    section = ".".join(str(k) for k in loc[:-1]) or "the top level"
    return f"unknown field; remove it ({section} has: {', '.join(model.model_fields)})"


def parse_run_config(data: dict, source: str = "<config>") -> RunConfig:
    """Validate a config already parsed from TOML or JSON."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None


def read_toml(path: str | Path) -> dict:
    """A TOML file's contents. Raises :class:`ConfigError` naming the file."""
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def load_run_config(path: str | Path) -> RunConfig:
    """Read, validate and resolve a run config file. Raises :class:`ConfigError`."""
    path = Path(path)
    return parse_run_config(read_toml(path), str(path)).resolve_paths(path.parent)


def serves_model(config: RunConfig, model_dir: str | Path) -> bool:
    """Whether a rollout server that loaded ``model_dir`` serves a run of ``config``: its ``model.path`` is
    that folder (the control plane stores the path as the deployment sees it: control_plane.model_path;
    with ``TANDEM_CONTROL_FLEET_MODEL`` it refuses a run that names another)."""
    return Path(config.model.path).resolve() == Path(model_dir).resolve()

