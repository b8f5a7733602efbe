"""``tandem export RUN [--version N|best|last] OUT``: a published weight version as a Hugging Face folder.

What it reads: the run's files that the learner leaves (``learner.trainer.Paths``): the versions in
``weights/`` (``services.weightstore``'s layout), ``run-config.json`` (the run config the learner
trained with, so the base model and the LoRA settings) and ``weights/retention.json`` (the held-out
scores retention knew). ``RUN`` is a run directory (``runs/<run_id>`` as ``tandem run`` leaves it,
or ``runs/stack/<run_id>`` under ``tandem up``) or a run id looked up in those two places.

What it writes, into ``OUT`` (built under a temporary name beside it and renamed into place, so a
failed export leaves nothing), either

- a **model folder** that ``AutoModelForCausalLM.from_pretrained(OUT)`` and ``vllm serve OUT``
  load: ``config.json`` (the base model's, its ``dtype`` set to the weights'),
  ``generation_config.json`` (the base model's, else one derived from ``config.json`` as
  transformers does), the tokenizer and every other file of the base model directory except its
  weights, and the weights as safetensors: one ``model.safetensors`` up to ``max_shard_bytes``,
  above it shards ``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json``
  (``metadata.total_size``, ``weight_map``), split the way ``save_pretrained`` splits (in order; a
  tensor that does not fit starts a new shard; one larger than the limit has a shard of its own).
  A full-weight version's tensors are copied byte for byte from its ``model.safetensors``; or
- a **PEFT adapter folder** (``--lora adapter``; only for a LoRA run that publishes adapters,
  ``publish.lora_format = "adapter"``): ``adapter_model.safetensors``, ``adapter_config.json``
  (``base_model_name_or_path`` names the base model directory) and the tokenizer files, which
  ``PeftModel.from_pretrained(base, OUT)`` loads.

A LoRA run's version becomes a model folder either way: with ``lora_format = "merged"`` it already
holds full weights; with ``"adapter"`` the adapter is merged into the base weights here (peft's
``merge_and_unload``, in float32, then cast to ``model.dtype`` as the learner's merged publish does;
needs torch, transformers and peft: the learner extra, which ``make run`` installs).

``OUT/tandem-export.json`` records where the folder came from (run, version, step, the version's
sha256, the base model).

Which version: ``last`` (the newest on disk, the default), a number, or ``best``: the kept version
with the highest held-out score, from ``retention.json``, the ``summary.json`` of a ``tandem run``
(its final evaluation came after the learner's last decision) and, while the ``tandem up`` stack
that holds the run still runs, the run's evaluation results in its Redis. A version that is not on
disk is an error that lists the versions that are (``publish.keep``, ``keep_every``, ``keep_best``
decide which stay).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from learner.retention import RETENTION_FILE, RUN_CONFIG_FILE
from services import weightstore as store
from services.config import ConfigError, RunConfig, load_run_config, parse_run_config

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""``5GB``: huggingface_hub's default shard size (transformers 4's ``save_pretrained``; 5.x uses 50GB)."""
INDEX_FILE = "model.safetensors.index.json"
EXPORT_RECORD = "tandem-export.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
_GENERATED = {"config.json", "generation_config.json", INDEX_FILE, "pytorch_model.bin.index.json", EXPORT_RECORD}
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


class ExportError(Exception):
    """The export cannot be made; the message says why (no such run, version not kept, ...)."""


def parse_size(text: str) -> int:
    """Bytes from ``"5GB"``, ``"500MB"``, ``"2GiB"`` or a plain number (decimal units, as huggingface_hub)."""
    m = _SIZE.match(text)
    if not m:
        raise ExportError(f"--max-shard-size {text!r}: write bytes or a size like 5GB, 500MB, 2GiB")
    size = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])
    if size < 1:
        raise ExportError(f"--max-shard-size {text!r}: must be at least one byte")
    return size


# -- the run --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunFiles:
    """Where one run's learner files are."""

    run_id: str
    base: Path
    """``<...>/<run_id>``: ``weights/``, ``run-config.json``, ``learner/``."""
    top: Path
    """The directory the user named or that was found: ``base`` or, for ``tandem run``, its parent."""

    @property
    def weights(self) -> Path:
        return self.base / "weights"

    def versions(self) -> list[int]:
        return store.on_disk(self.weights)

    def config(self) -> RunConfig:
        """The run config the learner wrote; for a run from before it wrote one, the TOML that
        ``summary.json`` names."""
        path = self.base / RUN_CONFIG_FILE
        if path.exists():
            try:
                return parse_run_config(json.loads(path.read_text()), str(path))
            except (ValueError, ConfigError) as e:
                raise ExportError(f"{path}: not a run config: {e}") from None
        summary = self.top / "summary.json"
        if summary.exists() and (toml := json.loads(summary.read_text()).get("config")) and Path(toml).exists():
            return load_run_config(toml)
        raise ExportError(f"{self.base}: no {RUN_CONFIG_FILE} (the learner writes it when it starts) and no "
                          "summary.json naming the run config")


def find_run(target: str, runs_root: Path = Path("runs"), stack_dir: Path = Path("runs/stack")) -> RunFiles:
    """The run named by ``target``: a run directory, or a run id under ``runs_root`` (``tandem run``)
    or ``stack_dir`` (``tandem up``). Raises :class:`ExportError` naming what it looked for."""
    path = Path(target)
    places = [path] if path.is_dir() else [runs_root / target, stack_dir / target]
    for top in places:
        for base in (top, top / top.name):  # runs/stack/<id> holds the files; runs/<id> holds <id>/
            if (base / "weights").is_dir() or (base / RUN_CONFIG_FILE).is_file():
                return RunFiles(run_id=base.name, base=base.resolve(), top=top.resolve())
    if path.is_dir():
        raise ExportError(f"{path} is not a run directory: no weights/ or {RUN_CONFIG_FILE} in it "
                          f"or in {path / path.name}")
    raise ExportError(f"no such run: {target} (not a directory, and no run directory "
                      f"{runs_root / target} or {stack_dir / target})")


def scores(run: RunFiles) -> dict[int, float]:
    """Held-out score by version, from every place one is recorded (see the module docstring)."""
    out: dict[int, float] = {}
    retention = run.weights / RETENTION_FILE
    if retention.exists():
        out |= {int(v): float(s) for v, s in json.loads(retention.read_text()).get("scores", {}).items()}
    summary = run.top / "summary.json"
    if summary.exists():
        out |= {int(e["version"]): float(e["accuracy"]) for e in json.loads(summary.read_text()).get("evals", [])}
    return out | _live_scores(run)


def _live_scores(run: RunFiles) -> dict[int, float]:
    """The run's evaluation results in the Redis of the ``tandem up`` stack that holds it, if that runs."""
    info = run.base.parent / "stack.json"
    if not info.exists():
        return {}
    import asyncio

    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from broker import Keys, connect
    from services.evaluate import EvalLog

    url = json.loads(info.read_text()).get("redis_url")

    async def read() -> dict[int, float]:
        redis = connect(url)  # a refused connection fails at once (no retries)
        try:
            points = await asyncio.wait_for(EvalLog(redis, Keys(run.run_id)).points(), 5.0)
            return {v: p.accuracy for v, p in points.items()}
        finally:
            await redis.aclose()

    try:
        return asyncio.run(read()) if url else {}
    except (RedisConnectionError, RedisTimeoutError, TimeoutError, OSError):
        return {}  # the stack is not running (stack.json stays after it stops): the files have the rest


def choose_version(run: RunFiles, which: str) -> int:
    """The version ``which`` (``last``, ``best`` or a number) names; raises :class:`ExportError`."""
    kept = run.versions()
    if not kept:
        raise ExportError(f"run {run.run_id} has no published version on disk ({run.weights})")
    listing = f"versions kept: {', '.join(map(str, kept))}"
    if which == "last":
        return kept[-1]
    if which == "best":
        known = {v: s for v, s in scores(run).items() if v in kept}
        if not known:
            raise ExportError(f"run {run.run_id}: no kept version has a held-out score (eval.every, "
                              f"publish.keep_best); {listing}")
        return max(known, key=lambda v: (known[v], v))
    if not which.isdigit():
        raise ExportError(f"--version {which!r}: a version number, 'best' or 'last'")
    version = int(which)
    if version not in kept:
        raise ExportError(f"run {run.run_id}: version {version} was not kept; {listing} "
                          "(publish.keep, keep_every and keep_best decide which stay)")
    return version


# -- safetensors, byte for byte ---------------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    """One tensor of a safetensors file: where its bytes are."""

    name: str
    dtype: str
    shape: list[int]
    path: Path
    offset: int
    """Of its first byte in ``path``."""
    nbytes: int


def tensors_of(path: Path) -> list[Tensor]:
    """The tensors of a safetensors file in the order of their data (the format: an 8-byte
    little-endian header length, a JSON header of dtype, shape and data offsets, then the data)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    out = [Tensor(name, h["dtype"], h["shape"], path, 8 + n + h["data_offsets"][0],
                  h["data_offsets"][1] - h["data_offsets"][0]) for name, h in header.items()]
    return sorted(out, key=lambda t: t.offset)


def shards(tensors: list[Tensor], max_bytes: int) -> list[list[Tensor]]:
    """Split in order as ``save_pretrained`` does: a tensor that would take a shard past ``max_bytes``
    starts the next one; a tensor larger than ``max_bytes`` has one of its own."""
    out: list[list[Tensor]] = []
    current: list[Tensor] = []
    size = 0
    for t in tensors:
        if t.nbytes > max_bytes:
            out.append([t])
            continue
        if current and size + t.nbytes > max_bytes:
            out.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current:
        out.append(current)
    return out


def write_safetensors(path: Path, tensors: list[Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file of ``tensors``, their bytes copied from their files, fsynced."""
    header: dict[str, object] = {"__metadata__": metadata}
    at = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the library writes it
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        sources: dict[Path, object] = {}
        try:
            for t in tensors:
                src = sources.get(t.path) or sources.setdefault(t.path, open(t.path, "rb"))  # noqa: SIM115
                src.seek(t.offset)
                left = t.nbytes
                while left:
                    chunk = src.read(min(left, 16 << 20))
                    if not chunk:
                        raise ExportError(f"{t.path}: ends inside tensor {t.name}")
                    out.write(chunk)
                    left -= len(chunk)
        finally:
            for src in sources.values():
                src.close()
        out.flush()
        os.fsync(out.fileno())


def write_model_weights(out: Path, tensors: list[Tensor], max_bytes: int, metadata: dict[str, str]) -> list[str]:
    """``model.safetensors``, or shards and ``model.safetensors.index.json``; returns the files written."""
    parts = shards(tensors, max_bytes)
    if len(parts) == 1:
        write_safetensors(out / store.WEIGHTS_FILE, parts[0], metadata)
        return [store.WEIGHTS_FILE]
    names = [f"model-{i:05d}-of-{len(parts):05d}.safetensors" for i in range(1, len(parts) + 1)]
    weight_map: dict[str, str] = {}
    for name, part in zip(names, parts, strict=True):
        write_safetensors(out / name, part, metadata)
        weight_map |= {t.name: name for t in part}
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX_FILE]


# -- the folder -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exported:
    path: Path
    version: int
    kind: str
    """``model`` or ``peft-adapter``."""
    files: list[str]


def _base_files(base: Path) -> Iterator[Path]:
    """The base model directory's files an export carries over: all but weights, configs it writes, hidden."""
    for p in sorted(base.iterdir()):
        if p.is_file() and not p.name.startswith(".") and p.name not in _GENERATED \
                and not p.name.endswith(_WEIGHT_SUFFIXES):
            yield p


def _model_config(base: Path, dtype: str) -> dict:
    config = json.loads((base / "config.json").read_text())
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
    for k in keys:
        config[k] = dtype
    return config


def _generation_config(base: Path, config: dict) -> dict:
    """The base model's ``generation_config.json``, else the token ids of ``config.json`` (as
    ``GenerationConfig.from_model_config`` takes them)."""
    path = base / "generation_config.json"
    if path.exists():
        return json.loads(path.read_text())
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
           if config.get(k) is not None}
    return {"_from_model_config": True, **ids}


def export(run: RunFiles, version: int, out: Path, *, lora: str = "merged",
           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Exported:
    """Write ``version`` of ``run`` to ``out`` (module docstring). Raises :class:`ExportError`."""
    cfg = run.config()
    base = Path(cfg.model.path)
    if not (base / "config.json").exists():
        raise ExportError(f"the run's base model {base} is not there (no config.json): the export takes the "
                          "config and tokenizer from it")
    src = store.version_dir(run.weights, version)
    try:
        record = store.read_record(src)
    except store.WeightStoreError as e:
        raise ExportError(f"version {version}: {e}") from None
    adapter = record.format == "peft-adapter"
    if lora not in ("merged", "adapter"):
        raise ExportError(f"--lora {lora!r}: merged or adapter")
    if lora == "adapter" and not adapter:
        raise ExportError(f"version {version} holds full weights (publish.lora_format = 'merged', or no "
                          "[learner.lora]): there is no adapter to export; leave out --lora adapter")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists: export into a new folder")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        files = [p.name for p in _base_files(base)]
        for p in _base_files(base):
            shutil.copy2(p, tmp / p.name)
        if lora == "adapter":
            kind = "peft-adapter"
            shutil.copy2(src / ADAPTER_WEIGHTS, tmp / ADAPTER_WEIGHTS)
            adapter_config = json.loads((src / ADAPTER_CONFIG).read_text())
            adapter_config["base_model_name_or_path"] = str(base)
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
            files += [ADAPTER_WEIGHTS, ADAPTER_CONFIG]
        else:
            kind = "model"
            weights = _merge_adapter(src, base, cfg, tmp / ".merged") if adapter else src / store.WEIGHTS_FILE
            tensors = tensors_of(weights)
            _check_names(tensors, base, version)
            dtypes = {_DTYPES.get(t.dtype, t.dtype) for t in tensors}
            config = _model_config(base, dtypes.pop() if len(dtypes) == 1 else cfg.model.dtype)
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            (tmp / "generation_config.json").write_text(json.dumps(_generation_config(base, config), indent=2) + "\n")
            files += ["config.json", "generation_config.json"]
            files += write_model_weights(tmp, tensors, max_shard_bytes, {"format": "pt"})
            shutil.rmtree(tmp / ".merged", ignore_errors=True)
        (tmp / EXPORT_RECORD).write_text(json.dumps({
            "run_id": run.run_id, "version": version, "step": record.step, "sha256": record.sha256,
            "published_format": record.format, "export": kind, "base_model": str(base),
        }, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(tmp, out)
    except FileNotFoundError:
        shutil.rmtree(tmp, ignore_errors=True)
        if src.exists():
            raise
        raise ExportError(f"version {version} went away while it was exported: the run still trains and "
                          "retention deleted it; export a kept version") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(out, version, kind, sorted([*files, EXPORT_RECORD]))


def _check_names(tensors: list[Tensor], base: Path, version: int) -> None:
    """The version's tensors are the base model's, name for name and shape for shape."""
    want = store.checkpoint_signature(base)
    have = {t.name: tuple(t.shape) for t in tensors}
    if have != want:
        missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        shapes = sorted(n for n in set(have) & set(want) if have[n] != want[n])
        raise ExportError(f"version {version} does not match its base model {base}: missing {missing[:5]}, "
                          f"unexpected {extra[:5]}, other shapes {shapes[:5]}")


def _merge_adapter(src: Path, base: Path, cfg: RunConfig, work: Path) -> Path:
    """The base model with the adapter of version directory ``src`` merged in, as one safetensors file
    in the checkpoint's layout (``save_pretrained``: tied weights left out, fused tensors reverted)."""
    try:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise ExportError(f"merging a LoRA adapter needs torch, transformers and peft "
                          f"(the learner extra: make run, or pip install -e '.[learner]' in the checkout): {e}") from None
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, src).merge_and_unload()
    merged.to(getattr(torch, cfg.model.dtype)).save_pretrained(work, max_shard_size="1000GB")
    return work / store.WEIGHTS_FILE
