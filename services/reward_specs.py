"""Reward specs: how to score one completion, and the limits of one sandboxed run.

A prompt-set line carries a spec (``services.prompt_lines`` parses it; the run config's
``reward`` section fills in the lines that name none); the control plane puts it into each
:class:`~services.wire.PromptGroup`, the rollout server passes it on in its
:class:`~services.wire.ScoreRequest`, and the reward server's verifiers
(``reward_server.verifiers``) score by it. :class:`Limits` also bounds a plain
``POST /v1/execute`` (:class:`~services.wire.ExecuteRequest`).

Every spec is validated where it is defined: patterns compile and stay small once their
counted repeats are written out (the reward server compiles them and compiling cannot be
interrupted), combined specs are bounded in depth and in leaves, judge URLs are plain http(s), a
python spec names a function (``module:name``) and gives it JSON data, never code.
The payloads that carry a spec live in :mod:`services.wire`; this module imports nothing of it.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, TypeVar, get_args
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator


class Spec(BaseModel):
    """Base of every spec: unknown fields are an error, values are immutable (as ``services.wire.Wire``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


Extract = Literal["answer_tag", "boxed", "last_number", "whole"]
"""Where the answer is in a completion: ``<answer>...</answer>`` (last one),
``\\boxed{...}`` (last one), the last number in the text, or the whole text."""


MAX_PATTERN_CHARS = 1000
"""Longest regular expression a spec may carry (``RegexSpec.pattern``, ``JudgeSpec.score_pattern``)."""
MAX_PATTERN_COPIES = 100_000
"""Most atoms a pattern may stand for once its counted repeats are written out: the reward
server's ``regex`` engine expands ``x{n}`` when compiling, and compiling cannot be interrupted,
so ``(?:a{1000}){1000}`` (17 characters) would hold a core for a second and bigger ones for ever."""


def _copies(parsed) -> int:
    """Atoms of a ``re._parser`` tree with counted repeats written out (unbounded ones at their minimum)."""
    c = re._constants  # private, like re._parser; the opcodes of the tree
    total = 0
    for op, av in parsed:
        if op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
            low, high, sub = av
            total += (low if high == c.MAXREPEAT else high) * _copies(sub)
        elif op is c.SUBPATTERN:
            total += _copies(av[3])
        elif op in (c.ASSERT, c.ASSERT_NOT):
            total += _copies(av[1])
        elif op is c.ATOMIC_GROUP:
            total += _copies(av)
        elif op is c.BRANCH:
            total += sum(_copies(branch) for branch in av[1])
        elif op is c.GROUPREF_EXISTS:
            total += sum(_copies(branch) for branch in av[1:] if branch is not None)
        else:
            total += 1
        if total > MAX_PATTERN_COPIES:  # stop early: nested repeats may stand for 2**64 copies
            break
    return total


def _valid_regex(value: str) -> str:
    """A spec's pattern must compile and stay small once expanded (a bad one is the request's
    error, named by its field). Checked with ``re``, which the light modules import; the
    reward server matches with ``regex`` (compatible syntax) under a timeout."""
    try:
        re.compile(value)
        # re._parser is private (3.11+); it is the parse re.compile just did, kept by re's cache.
        copies = _copies(re._parser.parse(value))
    except re.error as e:
        raise ValueError(f"invalid regular expression: {e}") from e
    if copies > MAX_PATTERN_COPIES:
        raise ValueError(f"counted repeats make this pattern stand for over {MAX_PATTERN_COPIES} "
                         "characters; use fewer or smaller {n} repeats")
    return value


class MathSpec(Spec):
    """Symbolic/numeric equivalence of the extracted answer and ``answer`` (math-verify)."""

    type: Literal["math"] = "math"
    answer: str = Field(min_length=1, description="Reference answer (LaTeX or plain).")
    extract: Extract = "answer_tag"


class ExactSpec(Spec):
    """String equality of the extracted answer and ``answer``."""

    type: Literal["exact"] = "exact"
    answer: str
    extract: Extract = "answer_tag"
    case_sensitive: bool = True
    strip: bool = True


class NumericSpec(Spec):
    """``|x - answer| <= tolerance`` (or relative) for the extracted number ``x``."""

    type: Literal["numeric"] = "numeric"
    answer: float = Field(allow_inf_nan=False)
    tolerance: float = Field(default=1e-6, ge=0, allow_inf_nan=False)
    relative: bool = False
    extract: Extract = "last_number"


class RegexSpec(Spec):
    """Format reward: 1 if ``pattern`` matches the completion (``search`` or ``fullmatch``)."""

    type: Literal["regex"] = "regex"
    pattern: str = Field(min_length=1, max_length=MAX_PATTERN_CHARS)
    mode: Literal["search", "fullmatch"] = "search"

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        return _valid_regex(value)


class Limits(Spec):
    """Resource limits of one sandboxed execution."""

    wall_s: float = Field(default=5.0, gt=0, le=300, description="Wall-clock limit.")
    cpu_s: float = Field(default=5.0, gt=0, le=300, description="CPU-time limit.")
    memory_mb: int = Field(default=256, ge=16, le=16384, description="Address-space limit.")
    processes: int = Field(default=32, ge=1, le=1024, description="Max processes/threads.")
    output_bytes: int = Field(default=1 << 20, ge=1024, le=64 << 20, description="stdout+stderr cap.")
    file_bytes: int = Field(default=16 << 20, ge=1024, le=1 << 30, description="Max size of a written file.")


class IOCase(Spec):
    """One stdin/stdout test: the program's stdout must equal ``stdout`` (trailing whitespace ignored)."""

    stdin: str = ""
    stdout: str


class PythonTestsSpec(Spec):
    """Run the completion's code against assert-style ``tests`` and ``io`` cases in the sandbox."""

    type: Literal["python_tests"] = "python_tests"
    tests: list[str] = Field(default_factory=list, description="Python statements, e.g. 'assert f(2) == 4'.")
    io: list[IOCase] = Field(default_factory=list)
    extract: Literal["fenced", "whole"] = "fenced"
    reward_mode: Literal["fraction", "all"] = "fraction"
    limits: Limits = Field(default_factory=Limits)

    @model_validator(mode="after")
    def _has_tests(self) -> PythonTestsSpec:
        if not self.tests and not self.io:
            raise ValueError("python_tests needs at least one of 'tests' or 'io'")
        return self


class JudgeSpec(Spec):
    """An LLM judge behind an OpenAI-compatible endpoint; reward = parsed score / max_score.

    ``url`` is a plain ``http(s)://host[:port][/path]`` base URL (no credentials, query or
    fragment). The reward server calls it only when it is on the server's allow-list
    (``TANDEM_REWARD_JUDGE_ALLOWED_URLS``, empty by default) and answers 422 naming the field
    otherwise; its own judge (``TANDEM_REWARD_JUDGE_URL``, the only one given its API key)
    serves specs without a url. The score is the *last* match of ``score_pattern`` in the
    judge's reply (``reward_server.verifiers.judge``)."""

    type: Literal["judge"] = "judge"
    url: str | None = Field(default=None, max_length=2048,
                            description="Base URL; None = the reward server's configured judge.")
    model: str = "judge"
    template: str = Field(
        default="Question:\n{prompt}\n\nReference:\n{reference}\n\nAnswer:\n{completion}\n\n"
        "Rate the answer from 0 to 10. Reply 'Score: N'.",
        description="Prompt with {prompt}, {completion}, {reference} placeholders.",
    )
    prompt: str = ""
    reference: str = ""
    score_pattern: str = Field(default=r"Score:\s*([0-9]+(?:\.[0-9]+)?)", min_length=1,
                               max_length=MAX_PATTERN_CHARS)
    max_score: float = Field(default=10.0, gt=0)

    @field_validator("score_pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        return _valid_regex(value)

    @field_validator("url")
    @classmethod
    def _plain_http(cls, value: str | None) -> str | None:
        if value is None:
            return value
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if "@" in parts.netloc or "?" in value or "#" in value or any(ch.isspace() for ch in value):
            raise ValueError("must not carry credentials, a query, a fragment or spaces")
        try:
            parts.port  # noqa: B018 - urlsplit checks the port only when it is read
        except ValueError as e:
            raise ValueError(f"bad port: {e}") from e
        return value


FUNCTION_NAME = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
"""A reward function's name: ``module:name`` (``my_rewards:length``, ``pkg.scoring:passes``)."""
TRL_KEYWORDS = frozenset({"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"})
"""Keywords TRL itself passes a reward function; a line's fields and ``args`` may not take them."""
MAX_KEYWORDS = 64
"""Keyword arguments (``args`` and ``kwargs`` together) one python spec may give its function."""


class PythonSpec(Spec):
    """A Python reward function in TRL's shape, ``f(prompts, completions, **kwargs) -> list[float | None]``,
    installed in the reward server's environment and allowed by its ``TANDEM_REWARD_FUNCTIONS``
    (``reward_server.verifiers.functions``; the reward server answers 422 naming any other).

    It is called with keywords, batched over the completions the reward server scores together:
    ``prompts`` and ``completions`` (one entry per completion), each ``kwargs`` field as a list
    (one value per completion, like a dataset column in TRL) and each ``args`` entry as it is. On
    a prompt-set line the fields that are not ``type``, ``function``, ``args`` or the prompt are
    the ``kwargs``: ``{"prompt": ..., "type": "python", "function": "my_rewards:match", "solution": "42"}``
    calls ``match(prompts=[...], completions=[...], solution=["42", ...])``. Names are Python
    identifiers other than TRL's own keywords (:data:`TRL_KEYWORDS`); ``args`` and ``kwargs`` share
    no name. A returned ``None`` means no reward for that completion."""

    type: Literal["python"] = "python"
    function: str = Field(max_length=200, description="module:name of the function.")
    args: dict[str, JsonValue] = Field(default_factory=dict,
                                       description="Keyword arguments passed as they are, the same for every completion.")
    kwargs: dict[str, JsonValue] = Field(default_factory=dict,
                                         description="The line's own fields, passed as one list per name.")

    @field_validator("function")
    @classmethod
    def _module_colon_name(cls, value: str) -> str:
        if not re.fullmatch(FUNCTION_NAME, value):
            raise ValueError("must be module:name, e.g. my_rewards:length or pkg.scoring:passes")
        return value

    @model_validator(mode="before")
    @classmethod
    def _line_fields_are_kwargs(cls, data: object) -> object:
        if isinstance(data, dict) and any(k not in cls.model_fields for k in data):
            extra = {k: v for k, v in data.items() if k not in cls.model_fields}
            given = data.get("kwargs")
            if isinstance(given, dict):
                both = sorted(set(given) & set(extra))
                if both:
                    raise ValueError(f"{both[0]!r} is both a field of the line and a key of kwargs")
                extra = {**given, **extra}
            data = {k: v for k, v in data.items() if k in cls.model_fields} | {"kwargs": extra}
        return data

    @model_validator(mode="after")
    def _names(self) -> PythonSpec:
        for name in [*self.args, *self.kwargs]:
            if not name.isidentifier() or not name.isascii() or len(name) > 64:
                raise ValueError(f"{name[:80]!r}: a keyword argument's name must be a Python identifier "
                                 "(ASCII, at most 64 characters)")
            if name in TRL_KEYWORDS:
                raise ValueError(f"{name!r} is a keyword TRL passes itself ({', '.join(sorted(TRL_KEYWORDS))})")
        both = sorted(set(self.args) & set(self.kwargs))
        if both:
            raise ValueError(f"{both[0]!r} is both in args and a field of the line (kwargs)")
        if len(self.args) + len(self.kwargs) > MAX_KEYWORDS:
            raise ValueError(f"{len(self.args) + len(self.kwargs)} keyword arguments; at most {MAX_KEYWORDS}")
        return self


S = TypeVar("S", bound=Spec)

MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""A reward model's name on the reward server (``TANDEM_REWARD_MODELS``' keys)."""


class RewardModelSpec(Spec):
    """A reward model scores prompt + completion: a Hugging Face sequence-classification model with one label,
    as TRL's ``reward_funcs`` scores with a model (``reward_server.verifiers.reward_models``): the pair
    rendered with the reward model's own chat template for a line of ``messages``, else the prompt text and
    the completion joined, and the model's ``logits[:, 0]`` is the reward. The line names the model; the
    reward server's operator says which models exist and where (``TANDEM_REWARD_MODELS``), so a prompt set
    never chooses a path. ``{"prompt": ..., "type": "reward_model", "model": "helpful"}``."""

    type: Literal["reward_model"] = "reward_model"
    model: str = Field(pattern=MODEL_NAME, description="The reward model's name on the reward server.")


MAX_COMBINED_DEPTH = 4
"""Combined specs nested in one another, the outermost counted (``combined(combined(x))`` is 2)."""
MAX_COMBINED_LEAVES = 16
"""Specs other than combined ones under one combined spec, every level together: what scoring one
completion fans out to (a python_tests leaf is a sandbox run)."""


def leaves_of(spec: object, where: str, kind: type[S]) -> list[tuple[str, S]]:
    """``(field path, spec)`` of every ``kind`` spec in ``spec``, combined parts included
    (``items.3.spec.parts.1.spec``)."""
    if isinstance(spec, kind):
        return [(where, spec)]
    if isinstance(spec, CombinedSpec):
        return [found for i, p in enumerate(spec.parts) for found in leaves_of(p.spec, f"{where}.parts.{i}.spec", kind)]
    return []


def spec_shape(spec: object) -> tuple[int, int]:
    """(combined nesting depth, leaf count) of a reward spec; a spec that is not combined is (0, 1)."""
    if not isinstance(spec, CombinedSpec):
        return 0, 1
    shapes = [spec_shape(part.spec) for part in spec.parts]  # validated parts: bounded recursion
    return 1 + max(depth for depth, _ in shapes), sum(leaves for _, leaves in shapes)


class WeightedSpec(Spec):
    weight: float = Field(allow_inf_nan=False)
    spec: RewardSpec


class CombinedSpec(Spec):
    """Weighted sum of several rewards (e.g. correctness + format).

    At most :data:`MAX_COMBINED_DEPTH` combined levels and :data:`MAX_COMBINED_LEAVES` leaf specs
    in all; weights are finite."""

    type: Literal["combined"] = "combined"
    parts: list[WeightedSpec] = Field(min_length=1, max_length=MAX_COMBINED_LEAVES)

    @model_validator(mode="after")
    def _bounded(self) -> CombinedSpec:
        depth, leaves = spec_shape(self)
        if depth > MAX_COMBINED_DEPTH:
            raise ValueError(f"combined specs nest {depth} deep; at most {MAX_COMBINED_DEPTH} are allowed")
        if leaves > MAX_COMBINED_LEAVES:
            raise ValueError(f"{leaves} specs under one combined spec; at most {MAX_COMBINED_LEAVES} are allowed")
        return self


RewardSpec = Annotated[
    MathSpec | ExactSpec | NumericSpec | RegexSpec | PythonTestsSpec | JudgeSpec | PythonSpec | RewardModelSpec
    | CombinedSpec,
    Field(discriminator="type"),
]
WeightedSpec.model_rebuild()
CombinedSpec.model_rebuild()

RewardType = Literal["math", "exact", "numeric", "regex", "python_tests", "judge", "python", "reward_model", "combined"]
"""The ``type`` of every spec in :data:`RewardSpec` (the run config's ``reward.type`` too)."""
REWARD_TYPES: tuple[str, ...] = get_args(RewardType)
