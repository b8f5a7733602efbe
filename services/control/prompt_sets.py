"""Prompt sets: uploaded JSON lines, validated line by line and stored in Redis.

Who talks to whom: a client (``tandem submit``, curl) uploads a file to the
control plane's ``POST /v1/prompt-sets``; the route feeds the body, chunk by
chunk as it arrives, to :class:`LineParser` and hands the result to
:class:`PromptSetStore`, which writes it to Redis (AOF) in one transaction.
``POST /v1/runs`` reads the lines back (``services.control.groups``).

A line is ``{"prompt": str, <reward-spec fields>}``: the spec fields are
those of one of ``services.wire.RewardSpec``'s types, named by ``"type"``.
A line without ``"type"`` takes the run config's ``reward.type`` and
``reward.extract`` when a run starts (at upload it is checked against
``default_type``). Blank lines are skipped. Prompt-set ids are content
hashes, so uploading the same file twice stores it once.
"""

from __future__ import annotations

import hashlib
import json
import time

import msgpack
import redis.asyncio as aioredis
from pydantic import TypeAdapter, ValidationError
from redis.exceptions import WatchError

from broker.keys import PROMPT_SETS, check_run_id, prompt_set, prompt_set_meta
from services.wire import REWARD_TYPES, PromptSetInfo, RewardSpec

MAX_ERRORS = 20
"""An upload stops being parsed after this many bad lines (the 422 lists them)."""

SPEC = TypeAdapter(RewardSpec)


class LineError(ValueError):
    """Bad lines: ``errors`` holds ``{"line", "field", "msg"}`` per problem."""

    def __init__(self, errors: list[dict]) -> None:
        self.errors = errors
        shown = "; ".join(format_error(e) for e in errors[:5])
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        super().__init__(shown + more)


def format_error(e: dict) -> str:
    where = f"line {e['line']}: " if e.get("line") else ""
    return f"{where}{e['field']}: {e['msg']}" if e.get("field") else f"{where}{e['msg']}"


def spec_errors(err: ValidationError, line: int) -> list[dict]:
    """Pydantic's errors on a reward spec as ``{"line", "field", "msg"}``, the union tag left out."""
    out = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        if e["type"] in ("union_tag_invalid", "union_tag_not_found"):
            field = ".".join(loc[1:] + ["type"])
            msg = "field required" if e["type"] == "union_tag_not_found" else (
                f"unknown reward type (expected one of {', '.join(REWARD_TYPES)})"
            )
            out.append({"line": line, "field": field, "msg": msg})
            continue
        field = ".".join(loc[1:]) or "spec"
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        out.append({"line": line, "field": field, "msg": msg})
    return out


def check_line(obj: object, line: int, default_type: str) -> tuple[dict, list[dict]]:
    """Validate one decoded line; return (the stored form, errors)."""
    if not isinstance(obj, dict):
        return {}, [{"line": line, "field": "", "msg": "expected a JSON object"}]
    fields = dict(obj)
    prompt = fields.pop("prompt", None)
    errors = []
    if prompt is None:
        errors.append({"line": line, "field": "prompt", "msg": "field required"})
    elif not isinstance(prompt, str) or not prompt:
        errors.append({"line": line, "field": "prompt", "msg": "must be a non-empty string"})
    typed = "type" in fields
    try:
        spec = SPEC.validate_python(fields if typed else {**fields, "type": default_type})
    except ValidationError as e:
        return {}, errors + spec_errors(e, line)
    if errors:
        return {}, errors
    if typed:
        return {"prompt": prompt, "spec": spec.model_dump(mode="json")}, []
    return {"prompt": prompt, "fields": fields}, []


class LineParser:
    """Incremental JSON-lines parser: ``feed`` chunks as they arrive, then ``finish``.

    Raises :class:`LineError` as soon as :data:`MAX_ERRORS` lines are bad,
    otherwise at :meth:`finish` if any were.
    """

    def __init__(self, default_type: str = "math") -> None:
        self.default_type = default_type
        self.lines: list[dict] = []
        self.types: dict[str, int] = {}
        self.errors: list[dict] = []
        self.nbytes = 0
        self._partial: list[bytes] = []
        self._lineno = 0

    def feed(self, chunk: bytes) -> None:
        self.nbytes += len(chunk)
        if b"\n" not in chunk:
            self._partial.append(chunk)  # joined once its line ends: no quadratic copying
            return
        first, *complete, last = chunk.split(b"\n")
        self._line(b"".join([*self._partial, first]))
        for raw in complete:
            self._line(raw)
        self._partial = [last]

    def finish(self) -> list[dict]:
        rest = b"".join(self._partial)
        self._partial = []
        if rest:
            self._line(rest)
        if self.errors:
            raise LineError(self.errors)
        if not self.lines:
            raise LineError([{"line": 0, "field": "", "msg": "the prompt set is empty (no JSON lines)"}])
        return self.lines

    def _line(self, raw: bytes) -> None:
        self._lineno += 1
        if self._lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a UTF-8 byte-order mark
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            return self._error({"line": self._lineno, "field": "", "msg": f"not valid UTF-8 (byte {e.start})"})
        if not text:
            return None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            return self._error({"line": self._lineno, "field": "", "msg": f"invalid JSON: {e.msg} (column {e.colno})"})
        stored, errors = check_line(obj, self._lineno, self.default_type)
        for e in errors:
            self._error(e)
        if not errors:
            self.lines.append(stored)
            kind = stored["spec"]["type"] if "spec" in stored else "default"
            self.types[kind] = self.types.get(kind, 0) + 1
        return None

    def _error(self, e: dict) -> None:
        self.errors.append(e)
        if len(self.errors) >= MAX_ERRORS:
            raise LineError(self.errors)


class PromptSetStore:
    """Stored prompt sets: a Redis list of msgpack lines plus a meta hash per set."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis

    async def save(self, lines: list[dict], nbytes: int, types: dict[str, int]) -> PromptSetInfo:
        """Store ``lines`` atomically (all or nothing) and return the set's info."""
        encoded = [msgpack.packb(line, use_bin_type=True) for line in lines]
        digest = hashlib.sha256()
        for e in encoded:
            digest.update(len(e).to_bytes(8, "little") + e)
        set_id = f"ps-{digest.hexdigest()[:20]}"
        info = PromptSetInfo(id=set_id, count=len(lines), bytes=nbytes, created_at=time.time(), reward_types=types)
        meta = {"count": info.count, "bytes": nbytes, "created_at": repr(info.created_at), "reward_types": json.dumps(types)}
        for _attempt in range(20):
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(prompt_set_meta(set_id))
                    if await pipe.exists(prompt_set_meta(set_id)):
                        break  # the same content is already stored
                    pipe.multi()
                    pipe.delete(prompt_set(set_id))
                    for i in range(0, len(encoded), 1000):
                        pipe.rpush(prompt_set(set_id), *encoded[i : i + 1000])
                    pipe.hset(prompt_set_meta(set_id), mapping=meta)
                    pipe.zadd(PROMPT_SETS, {set_id: info.created_at})
                    await pipe.execute()
                    return info
                except WatchError:
                    continue
        stored = await self.info(set_id)
        if stored is None:
            raise RuntimeError(f"prompt set {set_id} could not be stored")
        return stored

    async def info(self, set_id: str) -> PromptSetInfo | None:
        """The set's meta, or None when no such set is stored."""
        try:
            key = prompt_set_meta(check_run_id(set_id))
        except ValueError:
            return None
        raw = await self.redis.hgetall(key)
        if not raw:
            return None
        f = {k.decode(): v.decode() for k, v in raw.items()}
        return PromptSetInfo(
            id=set_id, count=int(f["count"]), bytes=int(f["bytes"]), created_at=float(f["created_at"]),
            reward_types=json.loads(f["reward_types"]),
        )

    async def lines(self, set_id: str) -> list[dict]:
        """Every stored line, in file order (``{"prompt", "spec"}`` or ``{"prompt", "fields"}``)."""
        raw = await self.redis.lrange(prompt_set(set_id), 0, -1)
        return [msgpack.unpackb(r, raw=False) for r in raw]
