"""Datasets into prompt-set lines: what ``tandem prompts import`` reads and sends.

Who talks to whom: the CLI (``deploy.prompts``) opens a dataset here, maps each row's columns
to the fields of one prompt-set line (``services.prompt_lines`` defines the line) and streams the
lines, as they are read, to the control plane's ``POST /v1/prompt-sets``. The control plane
validates them exactly as an uploaded file's: a bad row is reported by its number (rows are
numbered from 1 in the dataset's order, a CSV header not counted: row N is line N of the
upload) and nothing of the set is stored.

Sources (read with Hugging Face ``datasets``, the ``data`` extra; imported only here):

- a file: ``.jsonl``/``.json`` (JSON lines), ``.parquet``, ``.csv``/``.tsv``. Read in streaming
  mode: no Arrow cache is written and memory holds one batch of rows. CSV cells are read as
  strings (a CSV file has no types; a spec turns ``"4"`` into a number where it wants one), an
  empty cell as ``""``;
- a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (memory-mapped);
  another directory is read as a folder of data files;
- anything else is taken as a Hugging Face hub id (``--subset`` names its configuration), which
  needs the hub to be reachable.

Mapping: ``--map FIELD=COLUMN`` puts a column's value under a line field (``prompt``,
``messages``, a reward-spec field such as ``answer``, or a field a run's ``prompt.template``
fills in); only mapped columns are sent. ``--set FIELD=VALUE`` adds the same value to every line
(JSON if it parses, else the text). ``--reward TYPE`` writes ``"type": TYPE`` into every line:
the lines then keep that spec's own defaults (its ``extract``, say) whatever a run's ``reward``
section says; without it the lines take the run's ``reward.type`` and ``reward.extract``.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

FILE_KINDS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "csv"}
"""File suffix -> the ``datasets`` builder that reads it."""
CHUNK_BYTES = 256 << 10
"""Lines are sent in chunks of about this many bytes."""


class ImportProblem(ValueError):
    """A dataset that cannot be imported as asked; the message names the option, field or row."""


@dataclass(frozen=True)
class Source:
    """An opened dataset: its rows in order and, when known before reading, its column names."""

    rows: Iterable[dict]
    columns: list[str] | None
    description: str


def parse_pairs(values: list[str], option: str) -> list[tuple[str, str]]:
    """``["a=b,c=d", "e=f"]`` -> ``[("a", "b"), ("c", "d"), ("e", "f")]``; a field named twice is an error."""
    pairs: list[tuple[str, str]] = []
    for value in values:
        for item in value.split(",") if option == "--map" else [value]:
            key, sep, rest = item.partition("=")
            key, rest = key.strip(), rest.strip()
            if not sep or not key or not rest:
                raise ImportProblem(f"{option} {item!r}: expected FIELD=" + ("COLUMN" if option == "--map" else "VALUE"))
            if key in {k for k, _ in pairs}:
                raise ImportProblem(f"{option}: field {key!r} is given twice")
            pairs.append((key, rest))
    return pairs


def constant(text: str) -> object:
    """A ``--set`` value: JSON if it parses (``false``, ``3``, ``[1, 2]``), else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def open_source(source: str, *, split: str | None = None, subset: str | None = None) -> Source:
    """Open ``source`` (a file, a ``save_to_disk`` directory, a data directory or a hub id)."""
    try:
        import datasets
    except ImportError:
        raise ImportProblem("reading datasets needs the `datasets` package: make extras "
                            "(or pip install -e '.[data]' in the checkout)") from None
    path = Path(source)
    if path.is_file():
        kind = FILE_KINDS.get(path.suffix.lower())
        if kind is None:
            raise ImportProblem(f"{source}: unknown file type {path.suffix!r} (use {', '.join(sorted(FILE_KINDS))})")
        if split not in (None, "train"):
            raise ImportProblem(f"--split {split}: a single file has one split (train)")
        kwargs: dict = {}
        columns = None
        if kind == "csv":
            columns = _csv_header(path)
            kwargs = dict(features=datasets.Features({c: datasets.Value("string") for c in columns}),
                          keep_default_na=False, sep="\t" if path.suffix.lower() == ".tsv" else ",")
        try:
            rows = datasets.load_dataset(kind, data_files=str(path), split="train", streaming=True, **kwargs)
        except (ValueError, OSError) as e:
            raise ImportProblem(f"{source}: cannot read it as {kind}: {e}") from None
        return Source(rows, columns or rows.column_names, f"{path} ({kind})")
    if path.is_dir():
        if any((path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
            return _from_disk(datasets, path, split)
        try:
            rows = datasets.load_dataset(str(path), split=split or "train", streaming=True)
        except (ValueError, OSError) as e:
            raise ImportProblem(f"{source}: cannot read the directory's data files: {e}") from None
        return Source(rows, rows.column_names, f"{path} (data files)")
    try:
        rows = datasets.load_dataset(source, name=subset, split=split or "train", streaming=True)
    except Exception as e:  # noqa: BLE001  the hub client raises many kinds (offline, not found, gated)
        raise ImportProblem(
            f"{source}: no such file or directory here, and the Hugging Face hub could not load it as a "
            f"dataset id: {type(e).__name__}: {e}"
        ) from None
    return Source(rows, rows.column_names, f"hub dataset {source}" + (f" ({subset})" if subset else ""))


def _csv_header(path: Path) -> list[str]:
    with open(path, newline="", encoding="utf-8-sig") as f:
        header = next(csv.reader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ","), None)
    if not header:
        raise ImportProblem(f"{path}: the CSV file has no header row")
    return header


def _from_disk(datasets, path: Path, split: str | None) -> Source:
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        chosen = split or ("train" if "train" in splits or len(splits) != 1 else splits[0])
        if chosen not in loaded:
            raise ImportProblem(f"--split {chosen}: {path} has the splits {', '.join(splits)}")
        loaded = loaded[chosen]
        return Source(loaded, loaded.column_names, f"{path} (split {chosen})")
    if split not in (None, "train"):
        raise ImportProblem(f"--split {split}: {path} holds one dataset, not a dict of splits")
    return Source(loaded, loaded.column_names, str(path))


def prompt_lines(
    source: Source, mapping: list[tuple[str, str]], constants: list[tuple[str, object]],
    reward: str | None, limit: int | None = None,
) -> Iterator[bytes]:
    """One JSON line (with its newline) per row: the mapped columns, the constants and the reward type.

    Raises :class:`ImportProblem` for a mapped column the dataset lacks (before any row is read
    when the columns are known) and for a value JSON cannot hold, naming the row and field."""
    if not mapping:
        raise ImportProblem("--map: give at least one FIELD=COLUMN (e.g. --map prompt=question,answer=answer)")
    fields = [k for k, _ in mapping] + [k for k, _ in constants]
    clash = sorted({k for k, _ in mapping} & {k for k, _ in constants})
    if clash:
        raise ImportProblem(f"--set {clash[0]}: the field is also given by --map")
    if reward is not None and "type" in fields:
        raise ImportProblem("--reward: the field 'type' is also given by --map or --set")
    if source.columns is not None:
        _check_columns(mapping, source.columns, source.description)
    extra = dict(constants) | ({"type": reward} if reward is not None else {})
    for number, row in enumerate(source.rows, start=1):
        if limit is not None and number > limit:
            return
        if number == 1 and source.columns is None:
            _check_columns(mapping, list(row), source.description)
        line = {field: row.get(column) for field, column in mapping} | extra
        try:
            text = json.dumps(line, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):
            raise ImportProblem(f"row {number}: {_unjsonable(line)}") from None
        yield text.encode("utf-8") + b"\n"


def _check_columns(mapping: list[tuple[str, str]], columns: list[str], description: str) -> None:
    for field, column in mapping:
        if column not in columns:
            raise ImportProblem(f"--map {field}={column}: {description} has no column {column!r} "
                                f"(its columns: {', '.join(columns)})")


def _unjsonable(line: dict) -> str:
    """Which field of ``line`` JSON cannot hold, and why."""
    for field, value in line.items():
        try:
            json.dumps(value, allow_nan=False)
        except ValueError:
            return f"{field}: NaN or infinity is not a JSON number"
        except TypeError:
            return f"{field}: a {type(value).__name__} value is not JSON (map a text or number column)"
    return "a value JSON cannot hold"


def chunks(lines: Iterable[bytes], size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """``lines`` joined into request-body chunks of about ``size`` bytes."""
    pending: list[bytes] = []
    held = 0
    for line in lines:
        pending.append(line)
        held += len(line)
        if held >= size:
            yield b"".join(pending)
            pending, held = [], 0
    if pending:
        yield b"".join(pending)
