"""services.timeline.breakdown: the per-step seconds the dashboard stacks, from spans written by hand."""

from __future__ import annotations

import pytest

from services.timeline import LEARNER_ACTIVITIES, ROLLOUT_ACTIVITIES, Span, breakdown


def L(name, a, b, **attrs):  # noqa: N802
    return Span(name, "learner", "rank0", a, b, attrs)


def R(name, a, b, server="rollout:r0", **attrs):  # noqa: N802
    return Span(name, server, "groups", a, b, attrs)


def test_two_steps_tile_the_run_and_every_second_is_counted_once():
    spans = [
        L("read", 0, 2, step=1), L("step", 2, 5, step=1), L("forward", 2, 3, micro_batch=0),
        L("backward", 3, 4.5, micro_batch=0), L("optimizer", 4.5, 4.8), L("publish", 5, 6, step=1, version=1),
        L("read", 6.5, 7, step=2), L("step", 7, 8, step=2),
        # rollout r0: two groups overlap (counted once), a reload, a full admission wait
        R("generate", 0, 3, group="a"), R("generate", 1, 4, group="b"), R("score", 3.5, 4.5, group="a"),
        R("reload", 4.5, 5, version=1), R("admit", 5, 6, reason="full"), R("admit", 6, 6.1, reason="admitted"),
        R("generate", 6, 8, group="c"),
        # a second server, busy the whole of step 2 only
        R("generate", 6, 8, server="rollout:r1", group="d"),
    ]
    b = breakdown(spans)
    assert [x["step"] for x in b] == [1, 2]
    one, two = b
    assert (one["t0"], one["t1"], two["t0"], two["t1"]) == (0, 6, 6, 8)
    assert one["learner"] == pytest.approx(dict(zip(LEARNER_ACTIVITIES, [1, 1.5, 0.3, 0.2, 1, 0, 0, 2], strict=True)))
    # step 2: 0.5 s between the publish and the read are "other"
    assert two["learner"]["read"] == 0.5 and two["learner"]["other"] == pytest.approx(0.5)
    assert sum(one["learner"].values()) == pytest.approx(6) and sum(two["learner"].values()) == pytest.approx(2)
    assert one["rollout"] == pytest.approx(dict(zip(ROLLOUT_ACTIVITIES, [4, 0.5, 0, 0, 0.5, 1, 0, 0], strict=True)))
    assert sum(one["rollout"].values()) == pytest.approx(6), "r1 has no span in step 1's window: not counted"
    assert two["rollout"]["generate"] == pytest.approx(4) and sum(two["rollout"].values()) == pytest.approx(4)


def test_an_admission_that_waited_for_room_and_got_in_counts_as_full():
    """``reserve()`` waits up to its timeout for room: the wait of an admission that then got a ticket is
    time refused by the capacity, not unexplained idle."""
    spans = [L("read", 0, 2, step=1), L("step", 2, 3, step=1),
             R("admit", 0, 1, reason="admitted"), R("generate", 1, 3, group="a")]
    (one,) = breakdown(spans)
    assert one["rollout"]["full"] == pytest.approx(1) and one["rollout"]["idle"] == 0
    assert one["rollout"]["generate"] == pytest.approx(2)


def test_no_learner_steps_no_rows():
    assert breakdown([R("generate", 0, 1)]) == []
