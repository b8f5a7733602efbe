"""``tandem export`` (deploy/export.py) on run directories in the learner's layout, written with the
weight store's own writer: the folder transformers loads, byte-identical tensors, shards with an
index like ``save_pretrained``'s, the version chosen (a number, last, best), and errors that name
the problem. The export of weights the real learner trained, loaded by transformers, PEFT and vLLM,
is in tests/integration/deploy/test_export.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deploy.cli import app
from deploy.export import INDEX_FILE, parse_size
from learner.retention import RETENTION_FILE, RUN_CONFIG_FILE


def make_run(top: Path, base_model: Path, versions: dict[int, Path], *, run_id: str = "exp-run",
             layout: str = "run", **config) -> Path:
    """A run directory as the learner leaves it: versions written by ``services.weightstore`` (each
    with the weights of the model directory given), the run config as ``run-config.json``.
    ``layout="run"``: ``tandem run``'s ``<top>/<run_id>/<run_id>/``; ``"stack"``: ``<top>/<run_id>/``."""
    from safetensors.torch import load_file

    from services import weightstore as store
    from services.config import parse_run_config

    run_dir = top / run_id
    base = run_dir / run_id if layout == "run" else run_dir
    base.mkdir(parents=True)
    cfg = parse_run_config({"name": run_id, "model": {"path": str(base_model)}, "data": {"train": "t.jsonl"},
                            **config})
    (base / RUN_CONFIG_FILE).write_text(cfg.model_dump_json())
    for v, model in versions.items():
        store.write_version(base / "weights", v, load_file(model / "model.safetensors"), step=v)
    return run_dir


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory) -> Path:
    """Another tiny Qwen3 (seed 1): what the exported version holds, unlike the base model."""
    from examples.tiny import tiny_qwen3

    return tiny_qwen3(tmp_path_factory.mktemp("other") / "seed1", seed=1)


def index_names(index: dict, shard: str) -> list[str]:
    return [n for n, s in index["weight_map"].items() if s == shard]


def _export(*args: str):
    return CliRunner().invoke(app, ["export", *map(str, args)])


def _logits(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([[5, 17, 23, 40, 8, 9]])).logits


def test_a_version_becomes_a_folder_transformers_loads_with_the_versions_tensors(tmp_path, tiny_model, other_weights):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    run = make_run(tmp_path / "runs", tiny_model, {2: tiny_model, 3: other_weights})
    out = tmp_path / "export"
    result = _export(run, out, "--version", "3")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines()[-1] == str(out)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors", "tandem-export.json"} <= names
    assert INDEX_FILE not in names  # one shard: no index, as save_pretrained
    # byte for byte the version's tensors (the tied head left out, as published)
    exported, published = load_file(out / "model.safetensors"), load_file(other_weights / "model.safetensors")
    assert exported.keys() == published.keys() and "lm_head.weight" not in exported
    assert all(torch.equal(exported[k], published[k]) for k in published)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    record = json.loads((out / "tandem-export.json").read_text())
    assert (record["run_id"], record["version"], record["step"], record["export"]) == ("exp-run", 3, 3, "model")
    # transformers loads the folder: the version's model (seed 1), not the base's
    assert torch.allclose(_logits(out), _logits(other_weights), atol=1e-6)
    assert not torch.allclose(_logits(out), _logits(tiny_model), atol=1e-3)
    assert AutoTokenizer.from_pretrained(out)("1+2=").input_ids == AutoTokenizer.from_pretrained(tiny_model)("1+2=").input_ids


def test_weights_above_the_shard_size_are_sharded_with_an_index(tmp_path, tiny_model, other_weights):
    import torch
    from safetensors import safe_open

    run = make_run(tmp_path / "runs", tiny_model, {1: other_weights}, layout="stack")
    out = tmp_path / "sharded"
    limit = 30_000  # the MLP matrices (48 KiB) are larger: each gets a shard of its own
    result = _export(run, out, "--max-shard-size", f"{limit}")
    assert result.exit_code == 0, result.output
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and "model.safetensors" not in shards
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert set(index["weight_map"].values()) == set(shards)
    total = 0
    for shard in shards:
        with safe_open(out / shard, framework="pt") as f:
            sizes = {name: f.get_slice(name).get_shape() for name in f.keys()}
            nbytes = [f.get_tensor(name).nbytes for name in f.keys()]
        assert all(index["weight_map"][name] == shard for name in sizes)
        # at most the limit, unless the shard is one tensor larger than it
        assert sum(nbytes) <= limit or len(nbytes) == 1
        total += sum(nbytes)
    assert index["metadata"]["total_size"] == total
    # the same split as huggingface_hub's (what save_pretrained shards with), tensors in the published order
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import load_file

    published = load_file(run / "weights" / "v00000001" / "model.safetensors")
    split = split_torch_state_dict_into_shards(published, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=limit)
    assert {k: sorted(v) for k, v in split.filename_to_tensors.items()} == \
        {shard: sorted(index_names(index, shard)) for shard in shards}
    assert torch.allclose(_logits(out), _logits(other_weights), atol=1e-6)


def test_version_best_last_and_the_errors_that_name_the_problem(tmp_path, tiny_model, other_weights):
    run = make_run(tmp_path / "runs", tiny_model, {2: tiny_model, 4: other_weights, 6: tiny_model})
    weights = run / run.name / "weights"

    # no score anywhere: best has nothing to go by
    result = _export(run, tmp_path / "a", "--version", "best")
    assert result.exit_code == 1 and "no kept version has a held-out score" in result.output
    # the learner's scores (retention.json), then tandem run's final evaluation (summary.json) on top;
    # a deleted version's score does not count, a tie goes to the newer version
    (weights / RETENTION_FILE).write_text(json.dumps({"scores": {"2": 0.5, "3": 0.99, "4": 0.7}, "kept": [2, 4, 6]}))
    assert _export(run, tmp_path / "b", "--version", "best").exit_code == 0
    assert json.loads((tmp_path / "b" / "tandem-export.json").read_text())["version"] == 4
    (run / "summary.json").write_text(json.dumps({"evals": [{"version": 6, "accuracy": 0.7}]}))
    assert _export(run, tmp_path / "c", "--version", "best").exit_code == 0
    assert json.loads((tmp_path / "c" / "tandem-export.json").read_text())["version"] == 6
    # last by default; a run id found under --runs
    assert _export(run.name, tmp_path / "d", "--runs", run.parent).exit_code == 0
    assert json.loads((tmp_path / "d" / "tandem-export.json").read_text())["version"] == 6

    result = _export(run, tmp_path / "e", "--version", "3")
    assert result.exit_code == 1
    assert "version 3 was not kept" in result.output and "versions kept: 2, 4, 6" in result.output
    result = _export("no-such-run", tmp_path / "f", "--runs", tmp_path / "runs", "--stack-dir", tmp_path / "stack")
    assert result.exit_code == 1 and "no such run: no-such-run" in result.output
    result = _export(tmp_path, tmp_path / "g")
    assert result.exit_code == 1 and "is not a run directory" in result.output
    result = _export(run, tmp_path / "d")
    assert result.exit_code == 1 and "exists" in result.output
    result = _export(run, tmp_path / "h", "--lora", "adapter")
    assert result.exit_code == 1 and "no adapter to export" in result.output
    assert not (tmp_path / "h").exists() and not list(tmp_path.glob(".h.tmp-*"))
    (weights / "v00000002" / "tandem-version.json").unlink()
    result = _export(run, tmp_path / "i", "--version", "2")
    assert result.exit_code == 1 and "version 2: unreadable version record" in result.output


def test_a_version_that_does_not_match_its_base_model_is_refused(tmp_path, tiny_model):
    from examples.tiny import tiny_qwen3

    wider = tiny_qwen3(tmp_path / "wider", seed=0, hidden=32)
    run = make_run(tmp_path / "runs", tiny_model, {1: wider})
    result = _export(run, tmp_path / "out")
    assert result.exit_code == 1 and "does not match its base model" in result.output
    assert not (tmp_path / "out").exists()


def test_sizes():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8
    assert parse_size("2GiB") == 2 << 30 and parse_size("1234") == 1234
    with pytest.raises(Exception, match="size like"):
        parse_size("five")


@pytest.mark.slow  # over 5 s in make test-fast: make test runs it
async def test_best_reads_the_scores_of_a_running_stack_from_its_redis(tmp_path, tiny_model, other_weights, redis,
                                                                       redis_url, keys):
    """Under ``tandem up`` the final version's evaluation may come after the learner's last retention
    decision: the stack's Redis (``stack.json``) has it while the stack runs; a stopped stack's is skipped."""
    import asyncio

    from host.processes import free_port
    from services.evaluate import EvalLog, EvalResult

    stack = tmp_path / "stack"
    run = make_run(stack, tiny_model, {4: other_weights, 6: tiny_model}, run_id=keys.run_id, layout="stack")
    (run / "weights" / RETENTION_FILE).write_text(json.dumps({"scores": {"4": 0.5}, "kept": [4, 6]}))
    await EvalLog(redis, keys).record(6, EvalResult(0.75, 0.75, 8, frozenset({6}), 0), "rollout")

    def best(out: str, redis_at: str) -> int:
        (stack / "stack.json").write_text(json.dumps({"redis_url": redis_at}))
        result = _export(keys.run_id, tmp_path / out, "--version", "best", "--stack-dir", stack,
                         "--runs", tmp_path / "none")
        assert result.exit_code == 0, result.output
        return json.loads((tmp_path / out / "tandem-export.json").read_text())["version"]

    assert await asyncio.to_thread(best, "live", redis_url) == 6
    assert await asyncio.to_thread(best, "stopped", f"redis://127.0.0.1:{free_port()}/0") == 4
