"""Run reports: rich tables for the CLI, PNG plots and summary.json for a run directory.

The plots are the dashboard's charts (``services.runs.CHARTS``), drawn with
matplotlib (imported only when a report is written).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from rich.table import Table

from services import wire
from services.runs import CHARTS


def _fmt(x: float | int | None, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:.1%}" if pct else (f"{x:.3g}" if isinstance(x, float) else str(x))


def eval_text(point: wire.EvalPoint, every_k: bool = True) -> str:
    """A held-out result as the CLI shows it: ``45.0%`` (one greedy sample per prompt), or with n samples
    ``mean@8 45.0%, pass@1 45.0%, pass@2 60.0%, ..., pass@8 80.0%`` (``every_k=False``: pass@n only); then
    ``, reward 0.873`` where the mean reward is not the accuracy (a reward model's, partial credit)."""
    if point.samples <= 1:
        text = f"{point.accuracy:.1%}"
    else:
        ks = sorted(point.pass_at) if every_k else [k for k in point.pass_at if k == point.samples]
        text = ", ".join([f"mean@{point.samples} {point.accuracy:.1%}", *(f"pass@{k} {point.pass_at[k]:.1%}" for k in ks)])
    if reward_not_accuracy(point.reward_mean, point.accuracy):
        text += f", reward {point.reward_mean:.3g}"
    return text


def reward_not_accuracy(reward: float | None, accuracy: float) -> bool:
    """Whether a held-out mean reward says more than the accuracy beside it (rewards that are not all 0 or 1)."""
    return reward is not None and abs(reward - accuracy) > 1e-6


def pass_at(values: dict[str, float]) -> dict[int, float]:
    """k -> pass@k from an ``"eval"`` metric point's values (``pass_at_<k>``; empty for one sample)."""
    return {int(name[8:]): v for name, v in values.items() if name.startswith("pass_at_") and name[8:].isdigit()}


def runs_table(runs: list[wire.RunRecord]) -> Table:
    table = Table("run", "state", "step", "version", "prompt set", title="runs")
    for r in runs:
        table.add_row(r.run_id, r.state, str(r.step), str(r.policy_version), r.prompt_set_id)
    return table


def status_table(st: wire.RunStatus) -> Table:
    r, s, t = st.run, st.staleness, st.throughput
    table = Table("", "", title=f"run {r.run_id}", show_header=False)
    rows = [
        ("state", r.state + (f" ({r.error})" if r.error else "")),
        ("step / policy version", f"{r.step} / {r.policy_version}"),
        ("reward (mean)", _fmt(st.reward_mean)),
        ("held-out accuracy (first -> latest)", f"{_fmt(st.accuracy_first, True)} -> {_fmt(st.accuracy, True)}"
                                                + (f" (version {st.eval.version})" if st.eval is not None else "")),
        *([(f"held-out mean@{st.eval.samples} / pass@k", f"{eval_text(st.eval)} (version {st.eval.version})")]
          if st.eval is not None and st.eval.samples > 1 else []),
        ("staleness eta / max observed lag", f"{s.max_staleness} / {_fmt(s.max_observed_lag)}"),
        ("groups dropped", wire.dropped_text(st.dropped())),
        ("queued / in flight / backlog", f"{s.queued} / {s.in_flight} / {s.backlog}"),
        ("rollout / learner tokens/s", f"{_fmt(t.rollout_tokens_per_s)} / {_fmt(t.learner_tokens_per_s)}"),
        ("rollout / learner idle", f"{_fmt(t.rollout_idle_frac, True)} / {_fmt(t.learner_idle_frac, True)}"),
        *([("CPU-s per trained sample", cpu_text(st.cpu))] if st.cpu is not None else []),
    ]
    for k, v in rows:
        table.add_row(k, v)
    return table


def cpu_text(cpu: wire.CpuAccount) -> str:
    """``0.0158 (rollout 0.0061, learner 0.0052, ...)``: CPU-seconds per trained sample, the whole stack's
    then each service's, largest first; CPU-seconds instead before any sample trained."""
    if cpu.per_sample_s is None:
        return "no sample trained yet; CPU-s so far: " + ", ".join(
            f"{name} {c.cpu_s:.1f}" for name, c in sorted(cpu.services.items(), key=lambda kv: -kv[1].cpu_s))
    parts = sorted(cpu.services.items(), key=lambda kv: -(kv[1].per_sample_s or 0))
    return f"{cpu.per_sample_s:.4g} (" + ", ".join(f"{name} {c.per_sample_s:.3g}" for name, c in parts) + ")"


def series(points: list[wire.MetricPoint]) -> dict[str, list[tuple[int, float]]]:
    """Metric name -> [(step, value)] in arrival order, over every source."""
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for p in points:
        for name, value in p.values.items():
            out[name].append((p.step, value))
    return out


def write_plots(points: list[wire.MetricPoint], out_dir: Path) -> list[Path]:
    """One PNG per dashboard chart that has data; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = series(points)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for chart_id, (title, names) in CHARTS.items():
        present = [n for n in names if data.get(n)]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
        for name in present:
            xs, ys = zip(*sorted(data[name]), strict=True)
            ax.plot(xs, ys, marker="o", markersize=3, label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{chart_id}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def write_summary(path: Path, summary: dict) -> None:
    path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
