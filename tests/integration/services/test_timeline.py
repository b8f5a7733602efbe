"""The span recorder (services.timeline) against a real Redis: spans written in batches by its thread,
read back in order with their attributes, the stream capped, the heartbeat beating and removed at stop,
spans kept (not lost) while Redis refuses them."""

from __future__ import annotations

import threading
import time

import pytest

from services.timeline import Span, Timeline, append, read, read_file, write_file


async def test_spans_round_trip_through_the_stream(redis, redis_url, keys, tmp_path):
    tl = Timeline(redis_url, keys, "rollout:r0", flush_s=0.05).start()
    with tl.span("generate", "groups", group="g1") as a:
        a["tokens"] = 12
    with pytest.raises(ValueError), tl.span("score", "groups", group="g1"):
        raise ValueError("x")
    tl.add("admit", 10.0, 11.5, "admit", reason="full")
    time.sleep(0.3)
    beat = await redis.hget(keys.heartbeats, "rollout:r0")
    assert beat is not None and abs(float(beat) - time.time()) < 5
    tl.stop()
    spans = await read(redis, keys)
    assert [s.name for s in spans] == ["generate", "score", "admit"]
    gen, score, admit = spans
    assert gen.service == "rollout:r0" and gen.track == "groups" and gen.attrs == {"group": "g1", "tokens": 12}
    assert gen.start <= gen.end and abs(gen.start - time.time()) < 10
    assert score.attrs["error"] == "ValueError"
    assert (admit.start, admit.end, admit.attrs) == (10.0, 11.5, {"reason": "full"})
    assert await redis.hget(keys.heartbeats, "rollout:r0") is None, "a stopped recorder is gone, not stalled"
    write_file(tmp_path / "t.jsonl", spans)
    assert read_file(tmp_path / "t.jsonl") == spans


async def test_spans_from_many_threads_are_all_written(redis, redis_url, keys):
    tl = Timeline(redis_url, keys, "learner", flush_s=0.01).start()

    def work(k: int) -> None:
        for i in range(500):
            tl.add("step", i, i + 0.5, f"t{k}", i=i)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tl.stop()
    spans = await read(redis, keys, page=300)
    assert len(spans) == 2000 and tl.written == 2000
    for k in range(4):
        assert [s.attrs["i"] for s in spans if s.track == f"t{k}"] == list(range(500))


async def test_the_stream_is_capped(redis, redis_url, keys):
    tl = Timeline(redis_url, keys, "learner", maxlen=1000)
    for i in range(5000):
        tl.add("x", i, i + 1)
    tl.flush()
    n = await redis.xlen(keys.timeline)
    assert 1000 <= n < 5000
    assert (await read(redis, keys))[-1].start == 4999, "the newest spans are kept"


async def test_spans_wait_in_the_buffer_while_redis_is_away(redis, keys, redis_url):
    tl = Timeline("redis://127.0.0.1:1", keys, "learner")  # nothing listens there
    tl.add("step", 1, 2)
    with pytest.raises(Exception):  # noqa: B017  redis-py's ConnectionError
        tl.flush()
    tl.redis_url, tl._client = redis_url, None
    assert tl.flush() == 1
    assert [s.name for s in await read(redis, keys)] == ["step"]


async def test_an_off_recorder_records_nothing(redis, keys):
    tl = Timeline.off().start()
    with tl.span("generate") as a:
        a["x"] = 1
    tl.add("y", 0, 1)
    tl.stop()
    assert tl.flush() == 0 and not tl._buf


async def test_append_from_an_async_client(redis, keys):
    await append(redis, keys, [Span("stalled", "learner", "rank0", 1.0, 3.0, {"gap_s": 2.0})])
    assert await read(redis, keys) == [Span("stalled", "learner", "rank0", 1.0, 3.0, {"gap_s": 2.0})]
