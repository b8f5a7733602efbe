"""bench/episodes.py's smallest configuration on the session's vLLM engine and the bubblewrap reward
server: one episode per script, groups of 3. The figures it records must be sane: every episode made its
script's calls, a python call costs more than a calculator call and a session more with more calls, the
tools' waits are seen, and episodes run as one group finish sooner than one after another."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _bench():
    if "bench_episodes" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_episodes", ROOT / "bench/episodes.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_episodes"] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
    return sys.modules["bench_episodes"]


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.usefixtures("engine_left_serving")
async def test_the_smallest_run_records_sane_figures(rollout_engine, weight_versions, tiny_model, reward_servers,
                                                      tmp_path):
    from services import wire
    from services.clients import RewardClient
    from services.weightstore import digest
    from tests.fixtures.reward import REWARD_TOKEN

    bench = _bench()
    assert rollout_engine.max_model_len >= bench.MAX_MODEL_LEN
    full = bench.train_scripts(tiny_model, tmp_path / "model")
    weights = tmp_path / "weights"
    weights.mkdir()
    for f in full.glob("*.safetensors"):
        shutil.copy(f, weights / f.name)
    version = weight_versions.next_version()
    weight_versions.dirs[version] = weights.resolve()
    await rollout_engine.load_weights(wire.LoadWeights(version=version, uri=weights.resolve().as_uri(),
                                                       sha256=digest(weights)))
    server = reward_servers["bwrap"]
    reward = RewardClient(server.url, REWARD_TOKEN, attempts=2, max_total_s=60)
    try:
        r = await bench.measure(rollout_engine, reward, episodes=1, concurrency=3, reward_pid=server.pid)
    finally:
        await reward.aclose()
    print(bench.report(r))

    for prompt, (_tool, calls, _end) in bench.SCRIPTS.items():
        v = r["split"][prompt]
        assert (v["calls"], v["errors"]) == (len(calls), 0), (prompt, v)
        assert 0 < v["generate_s"] and v["generate_s"] + v["tool_s"] <= v["wall_s"] * 1.01
    lat = r["latency"]
    assert lat["python"]["calls"] == sum(len(bench.SCRIPTS[p][1]) for p in bench.SESSION_SCRIPTS)
    assert lat["python"]["p50_ms"] > 10 * lat["calculator"]["p50_ms"]
    assert lat["remote"]["p50_ms"] >= bench.REMOTE_S * 1e3
    s = r["sessions"]
    assert 0 < s["P1:"]["tool_s"] < s["P4:"]["tool_s"]
    assert s["P4:"]["sandbox_cpu_s"] > 0 and s["P4:"]["reward_tree_cpu_s"] > 0
    assert r["split"]["C:"]["tool_frac"] < 0.2 < r["split"]["R:"]["tool_frac"]
    for prompt, c in r["concurrent"].items():
        for mode in ("sequential", "concurrent"):
            assert 0 < c[mode]["engine_busy_frac"] <= 1, (prompt, c)
    assert r["concurrent"]["P2:"]["concurrent"]["tool_wait_s"] > 0
    # the python calls of a group queue on the reward server's sandbox workers (2 here): P2's gain is small and
    # load-dependent, so only the calculator's (batching) and the remote tool's (overlapped waits) are asserted
    assert r["concurrent"]["C:"]["concurrent"]["wall_s"] < r["concurrent"]["C:"]["sequential"]["wall_s"]
    assert r["concurrent"]["R:"]["speedup"] > 1.5  # three episodes' 2 x 0.2 s waits overlap (3x at best)
    mix = r["concurrent"]["mix"]  # a group of each script at once: the engine generates more per second of wall
    assert mix["concurrent"]["model_tokens_per_s"] > mix["sequential"]["model_tokens_per_s"]
    assert mix["concurrent"]["on_script"] == 1 and mix["concurrent"]["errors"] == 0
