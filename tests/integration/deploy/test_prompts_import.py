"""``tandem prompts import`` (and list/show/delete, runs, stop) as a user runs it: the real CLI in its own
process, Parquet/CSV/JSONL files and ``save_to_disk`` folders made here with Hugging Face ``datasets``,
streamed into a real control plane on real Redis."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import pytest

from tests.fixtures.control import TOKEN

ROOT = Path(__file__).resolve().parents[3]
ROWS = [
    {"question": "What is 2+2?", "answer": "4", "conversation": [{"role": "user", "content": "What is 2+2?"}]},
    {"question": "What is 3+5?", "answer": "8",
     "conversation": [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+5?"}]},
    {"question": "What is 9+1?", "answer": "10", "conversation": [{"role": "user", "content": "9+1?"}]},
]


async def tandem(*args: str, **env: str) -> tuple[int, str, str]:
    """Run the CLI (``python -m deploy.cli``) without blocking the control plane served in this loop."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "deploy.cli", *args, cwd=ROOT,
        env={**clean, "TANDEM_TOKEN": TOKEN, "COLUMNS": "250", "HF_DATASETS_CACHE": env.pop("cache", str(Path(tempfile.gettempdir()) / "tandem-test-datasets")), **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    return proc.returncode, out.decode(), err.decode()


@pytest.fixture
def files(tmp_path):
    from datasets import Dataset, DatasetDict

    ds = Dataset.from_list(ROWS)
    ds.to_parquet(tmp_path / "rows.parquet")
    ds.select_columns(["question", "answer"]).to_csv(tmp_path / "rows.csv", index=False)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    DatasetDict({"train": ds, "test": ds.select([2, 0])}).save_to_disk(tmp_path / "splits")
    ds.save_to_disk(tmp_path / "one")
    Dataset.from_list([{**r, "question": "" if i == 2 else r["question"]} for i, r in enumerate(ROWS)]).to_parquet(
        tmp_path / "empty_row3.parquet")
    Dataset.from_list([{"q": "a", "x": 1.0}, {"q": "b", "x": math.nan}]).to_parquet(tmp_path / "nan_row2.parquet")
    return tmp_path


async def _stored(redis, set_id: str) -> list[dict]:
    from control_plane.prompt_sets import PromptSetStore

    return await PromptSetStore(redis).lines(set_id)


@pytest.mark.long  # over 12 s in make test (docs/testing.md): make test-long runs it
@pytest.mark.slow  # over 9 s: make test, not make test-fast
async def test_parquet_messages_csv_prompts_and_jsonl_template_fields_import_as_prompt_sets(
    serve_control, control_redis, files, tmp_path
):
    async with serve_control() as url:
        code, out, err = await tandem("prompts", "import", str(files / "rows.parquet"), "--url", url,
                                      "--map", "messages=conversation,answer=answer", "--reward", "exact")
        assert code == 0, err
        set_id = out.strip().splitlines()[-1]
        assert set_id.startswith("ps-") and "imported 3 rows" in err and "messages 3" in err
        lines = await _stored(control_redis, set_id)
        assert [ln["messages"] for ln in lines] == [r["conversation"] for r in ROWS]
        assert [(ln["spec"]["type"], ln["spec"]["answer"]) for ln in lines] == [("exact", "4"), ("exact", "8"),
                                                                                 ("exact", "10")]

        # CSV cells are text (an exact spec's answer must be), and a numeric spec reads the number from it
        code, out, err = await tandem("prompts", "import", str(files / "rows.csv"), "--url", url,
                                      "--map", "prompt=question", "--map", "answer=answer", "--reward", "exact")
        assert code == 0, err
        lines = await _stored(control_redis, out.strip().splitlines()[-1])
        assert [(ln["prompt"], ln["spec"]["answer"]) for ln in lines] == [
            ("What is 2+2?", "4"), ("What is 3+5?", "8"), ("What is 9+1?", "10")]
        code, out, err = await tandem("prompts", "import", str(files / "rows.csv"), "--url", url,
                                      "--map", "prompt=question,answer=answer", "--reward", "numeric")
        assert code == 0, err
        assert [ln["spec"]["answer"] for ln in await _stored(control_redis, out.strip().splitlines()[-1])] == [
            4.0, 8.0, 10.0]

        # fields for a run's prompt.template, untyped (the run's reward.type decides), a constant added
        code, out, err = await tandem("prompts", "import", str(files / "rows.jsonl"), "--url", url,
                                      "--map", "question=question,answer=answer", "--set", "extract=boxed")
        assert code == 0, err
        lines = await _stored(control_redis, out.strip().splitlines()[-1])
        assert lines[0] == {"inputs": {"question": "What is 2+2?"}, "fields": {"answer": "4", "extract": "boxed"}}


@pytest.mark.slow  # over 5 s in make test-fast: make test runs it
async def test_save_to_disk_folders_import_a_chosen_split(serve_control, control_redis, files):
    async with serve_control() as url:
        code, out, err = await tandem("prompts", "import", str(files / "splits"), "--url", url, "--split", "test",
                                      "--map", "prompt=question,answer=answer", "--limit", "1")
        assert code == 0, err
        assert [ln["prompt"] for ln in await _stored(control_redis, out.strip().splitlines()[-1])] == ["What is 9+1?"]
        code, _, err = await tandem("prompts", "import", str(files / "splits"), "--url", url, "--split", "dev",
                                    "--map", "prompt=question")
        assert code == 2 and "--split dev" in err and "train, test" in err, err
        code, out, err = await tandem("prompts", "import", str(files / "one"), "--url", url,
                                      "--map", "prompt=question,answer=answer")
        assert code == 0, err
        assert len(await _stored(control_redis, out.strip().splitlines()[-1])) == 3


@pytest.mark.long  # over 12 s in make test (docs/testing.md): make test-long runs it
@pytest.mark.slow  # over 9 s: make test, not make test-fast
async def test_bad_input_names_the_row_or_field_and_stores_nothing(serve_control, control_redis, files, snapshot):
    async with serve_control() as url:
        before = await snapshot(control_redis)
        # the control plane's own validation, reported by row
        code, out, err = await tandem("prompts", "import", str(files / "empty_row3.parquet"), "--url", url,
                                      "--map", "prompt=question,answer=answer", "--reward", "math")
        assert code == 1 and "row 3: prompt: must be a non-empty string" in err and "nothing was stored" in err, err
        assert out == ""
        # a value JSON cannot hold, found while the rows stream (row 1 was already sent)
        code, out, err = await tandem("prompts", "import", str(files / "nan_row2.parquet"), "--url", url,
                                      "--map", "prompt=q,answer=x")
        assert code == 2 and "row 2: answer: NaN" in err and "nothing was stored" in err, err
        # a column the dataset lacks: named, with the columns it has, before anything is sent
        code, _, err = await tandem("prompts", "import", str(files / "rows.parquet"), "--url", url,
                                    "--map", "prompt=questoin")
        assert code == 2 and "--map prompt=questoin" in err and "question, answer, conversation" in err, err
        code, _, err = await tandem("prompts", "import", str(files / "rows.parquet"), "--url", url, "--map", "prompt")
        assert code == 2 and "expected FIELD=COLUMN" in err, err
        code, _, err = await tandem("prompts", "import", str(files / "rows.parquet"), "--url", url,
                                    "--map", "prompt=question", "--reward", "maths")
        assert code == 2 and "--reward maths: unknown reward type" in err, err
        # not a file here, and the hub cannot be reached (offline): said so, naming the source
        code, _, err = await tandem("prompts", "import", "no-such-org/no-such-dataset", "--url", url,
                                    "--map", "prompt=question", HF_HUB_OFFLINE="1", cache=str(files / "hf"))
        assert code == 2 and "no-such-org/no-such-dataset: no such file or directory here" in err, err
        assert await snapshot(control_redis) == before


@pytest.mark.long  # over 12 s in make test (docs/testing.md): make test-long runs it
@pytest.mark.slow  # over 9 s: make test, not make test-fast
async def test_list_show_submit_runs_stop_and_delete_from_the_command_line(serve_control, control_redis, files):
    async with serve_control() as url:
        code, out, err = await tandem("prompts", "import", str(files / "rows.jsonl"), "--url", url,
                                      "--map", "prompt=question,answer=answer", "--reward", "exact")
        assert code == 0, err
        set_id = out.strip().splitlines()[-1]
        code, out, err = await tandem("prompts", "list", "--url", url, "--json")
        assert code == 0 and [s["id"] for s in json.loads(out)] == [set_id], err
        code, out, err = await tandem("prompts", "show", set_id, "--url", url)
        assert code == 0 and set_id in out and "exact 3" in out and "prompt 3" in out, (out, err)

        config = files / "run.toml"
        (files / "model").mkdir()  # a folder the control plane sees (it refuses a model.path it cannot)
        config.write_text('name = "imported"\n[model]\npath = "model"\nmax_model_len = 64\n'
                          '[data]\ntrain = "unused.jsonl"\n[sampling]\nmax_tokens = 16\n')
        code, out, err = await tandem("submit", "--prompt-set", set_id, "--config", str(config), "--url", url)
        assert code == 0 and f"prompt set {set_id}: 3 prompts" in err, err
        run_id = out.strip().splitlines()[-1]
        assert run_id.startswith("imported-")
        code, out, err = await tandem("runs", "--url", url)
        assert code == 0 and run_id in out and "queued" in out, (out, err)
        code, out, err = await tandem("stop", run_id, "--url", url)
        assert code == 0 and out.strip() == f"run {run_id}: stopped", (out, err)
        code, out, err = await tandem("stop", run_id, "--url", url)
        assert code == 1 and "409" in err, err  # a stopped run cannot be stopped again

        code, out, err = await tandem("prompts", "delete", set_id, "--url", url)
        assert code == 0 and f"deleted prompt set {set_id} (3 lines)" in out, (out, err)
        code, out, err = await tandem("prompts", "show", set_id, "--url", url)
        assert code == 1 and f"404 from /v1/prompt-sets/{set_id}" in err, err
