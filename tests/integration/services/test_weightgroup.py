"""services.weightgroup over real gloo: a learner rank and members in threads or processes of this machine."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from host.processes import free_port
from services.weightgroup import BroadcastFailed, WeightGroup, layout, manifest, read_manifest


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(37, 8, generator=g),
        "model.norm.weight": torch.randn(8, generator=g).to(torch.bfloat16),  # 16 bytes: offsets realign
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 21, generator=g),
        "scalar": torch.tensor(3, dtype=torch.int64),
    }


def _run_members(port: int, world: int, timeout_s: float = 20.0) -> tuple[list, list, list]:
    got, errors = [None] * world, []

    def member(rank: int) -> None:
        try:
            got[rank] = WeightGroup("127.0.0.1", port, rank, world, timeout_s=timeout_s).receive()
        except BaseException as e:  # noqa: BLE001  reported by the test
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(1, world)]
    for t in threads:
        t.start()
    return got, errors, threads


def test_layout_packs_aligned_without_splitting_a_tensor():
    entries = manifest(_tensors())
    buckets = layout(entries, bucket_bytes=1200)
    placed = [i for b in buckets for i, _ in b.entries]
    assert placed == list(range(len(entries)))
    for b in buckets:
        for i, offset in b.entries:
            assert offset % 16 == 0
            assert offset + entries[i].nbytes <= b.size
        assert b.size <= 1200 or len(b.entries) == 1  # only a tensor larger than a bucket overflows it
    assert len(buckets) > 1


@pytest.mark.parametrize("bucket_bytes", [64, 1 << 20])
def test_members_receive_every_tensor_bit_for_bit_and_the_same_digest(bucket_bytes):
    tensors, port, world = _tensors(), free_port(), 3
    sender = WeightGroup("127.0.0.1", port, 0, world, timeout_s=20.0)
    got, errors, threads = _run_members(port, world)
    digest = sender.send(tensors, bucket_bytes=bucket_bytes)
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert read_manifest("127.0.0.1", port, timeout_s=5.0) == manifest(tensors)
    for received, member_digest in got[1:]:
        assert member_digest == digest
        assert list(received) == list(tensors)
        for name, t in tensors.items():
            assert received[name].dtype == t.dtype and torch.equal(received[name], t), name


def test_a_member_that_never_joins_costs_the_learner_the_timeout_then_fails():
    sender = WeightGroup("127.0.0.1", free_port(), 0, 2, timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(BroadcastFailed):
        sender.send(_tensors())
    assert time.monotonic() - t0 < 15.0


MEMBER = """
import sys, time
from services.weightgroup import WeightGroup
g = WeightGroup("127.0.0.1", int(sys.argv[1]), 1, 2, timeout_s=30.0)
g._group()  # joined; then hangs like a server stuck mid-broadcast until it is killed
print("joined", flush=True)
time.sleep(600)
"""


def test_a_member_killed_mid_broadcast_cannot_hang_the_learner(tmp_path):
    port = free_port()
    sender = WeightGroup("127.0.0.1", port, 0, 2, timeout_s=5.0)
    proc = subprocess.Popen([sys.executable, "-c", MEMBER, str(port)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        big = {f"w{i}": torch.zeros(1 << 18) for i in range(8)}  # 8 buckets of 1 MiB
        failure: list[BaseException] = []

        def send() -> None:
            try:
                sender.send(big, bucket_bytes=1 << 20)
            except BaseException as e:  # noqa: BLE001
                failure.append(e)

        t = threading.Thread(target=send, daemon=True)
        t.start()
        assert proc.stdout.readline().strip() == "joined"
        proc.kill()
        t0 = time.monotonic()
        t.join(30)
        assert not t.is_alive(), "the learner is still blocked 30 s after its member died"
        assert failure and isinstance(failure[0], BroadcastFailed), failure
        assert time.monotonic() - t0 < 15.0
    finally:
        proc.kill()
        proc.wait()


class LyingLearner(WeightGroup):
    """A learner whose digest does not match what it sent (the bytes were changed on the way)."""

    def _announce_digest(self, digest: str) -> None:
        super()._announce_digest("0" * 64)


def test_a_member_refuses_weights_whose_digest_differs_from_the_learners():
    port, tensors = free_port(), _tensors()
    got, errors, threads = _run_members(port, 2)
    LyingLearner("127.0.0.1", port, 0, 2, timeout_s=20.0).send(tensors)
    threads[0].join(30)
    assert got[1] is None
    assert len(errors) == 1 and isinstance(errors[0], BroadcastFailed) and "digest" in str(errors[0])
