"""The judged example end to end: ``tandem run`` of examples/judge_arith/run.toml, a reward model as the only reward.

The run builds the judge (examples/judge_arith/judge.py) beside the arith policy (the session's
``arith_model``, copied under the test's directory, so the cold start reuses it and trains the judge alone),
then GRPO trains the policy with the judge's scores. The reward server is told where the judge is as a user
tells it, ``TANDEM_REWARD_MODELS``. Checked:

- the run finishes and its audit passes (``tandem run`` exits 0, summary.json's ``audit``);
- the held-out reward (the judge's mean score of greedy answers to eval.jsonl, versions 0 and the final one)
  rises by more than :data:`MARGIN` (measured 0.502 -> 0.761 in 40 steps, examples/judge_arith/run.toml);
- what the judge rewards rose in fact: the final version's greedy answers to :data:`REPLAYED` held-out
  prompts, generated here with Hugging Face and read by the test (not the judge), are even more often
  than version 0's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.e2e.tandem_job import tandem_run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "judge_arith"
MARGIN = 0.1
"""Least rise of the held-out reward, and of the share of even greedy answers (measured: the docstring)."""
REPLAYED = 100
TIMEOUT_S = 900


def _even_share(model: Path, weights: Path | None, prompts: list[str]) -> float:
    """The share of ``prompts`` whose greedy answer (Hugging Face, ``weights`` loaded if given) is
    ``<answer>N</answer>`` with N even."""
    import re

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    if weights is not None:
        missing, unexpected = policy.load_state_dict(load_file(weights / "model.safetensors"), strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    even = 0
    for prompt in prompts:
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = policy.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        found = re.fullmatch(r"<answer>(\d+)</answer>", tok.decode(out[0, len(ids):], skip_special_tokens=True))
        even += found is not None and int(found[1]) % 2 == 0
    return even / len(prompts)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 120)
def test_tandem_run_with_a_reward_model_as_judge_raises_its_held_out_score(tmp_path, arith_model):
    from examples.judge_arith.bootstrap import JUDGE
    from services.config import load_run_config
    from services.weightstore import parse_version_dir

    model = tmp_path / "models" / "arith"
    shutil.copytree(arith_model, model)
    text = (EXAMPLE / "run.toml").read_text()
    text = text.replace('path = "../../runs/models/arith"', f'path = "{model}"')
    text = text.replace('train = "train.jsonl"', f'train = "{EXAMPLE / "train.jsonl"}"')
    text = text.replace('eval = "eval.jsonl"', f'eval = "{EXAMPLE / "eval.jsonl"}"')
    config = tmp_path / "run.toml"
    config.write_text(text)
    cfg = load_run_config(config)
    assert (cfg.model.bootstrap, cfg.model.path, cfg.reward.type) == ("judge_arith", model, "reward_model")

    runs = tmp_path / "runs"
    done = tandem_run(config, runs, {"TANDEM_REWARD_MODELS": json.dumps({"even": str(tmp_path / "models" / JUDGE)})},
                      TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "models" / JUDGE / "config.json").exists()  # the cold start built the judge

    (summary_path,) = runs.glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == cfg.learner.steps and summary["audit"]["ok"], summary
    before, after = summary["held_out_reward_before"], summary["held_out_reward_after"]
    print(f"held-out reward {before:.3f} -> {after:.3f} ({summary['eval_prompts']} prompts)")
    assert after > before + MARGIN, summary["evals"]

    prompts = [json.loads(x)["prompt"] for x in (EXAMPLE / "eval.jsonl").read_text().splitlines()[:REPLAYED]]
    final = max((d for d in runs.rglob("v*") if d.is_dir() and parse_version_dir(d) is not None), key=parse_version_dir)
    share0, share1 = _even_share(model, None, prompts), _even_share(model, final, prompts)
    print(f"even greedy answers on {REPLAYED} held-out prompts: {share0:.2f} -> {share1:.2f} ({final.name})")
    assert share1 > share0 + MARGIN, (share0, share1)
