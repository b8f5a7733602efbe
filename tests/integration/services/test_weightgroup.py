"""services.weightgroup over real gloo: a learner rank and members in threads or processes of this machine."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from pydantic import SecretStr

from host.processes import free_port
from services.weightgroup import (
    BroadcastFailed,
    WeightGroup,
    broadcast_key,
    layout,
    manifest,
    read_manifest,
)

KEY = broadcast_key(SecretStr("weight-group-test-token"))


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
            got[rank] = WeightGroup("127.0.0.1", port, rank, world, key=KEY, timeout_s=timeout_s).receive()
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
    sender = WeightGroup("127.0.0.1", port, 0, world, key=KEY, timeout_s=20.0)
    got, errors, threads = _run_members(port, world)
    digest = sender.send(tensors, bucket_bytes=bucket_bytes)
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert read_manifest("127.0.0.1", port, key=KEY, timeout_s=5.0) == manifest(tensors)
    for received, member_digest in got[1:]:
        assert member_digest == digest
        assert list(received) == list(tensors)
        for name, t in tensors.items():
            assert received[name].dtype == t.dtype and torch.equal(received[name], t), name


def test_a_member_that_never_joins_costs_the_learner_the_timeout_then_fails():
    sender = WeightGroup("127.0.0.1", free_port(), 0, 2, key=KEY, timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(BroadcastFailed):
        sender.send(_tensors())
    assert time.monotonic() - t0 < 15.0


MEMBER = """
import sys, time
from services.weightgroup import WeightGroup
g = WeightGroup("127.0.0.1", int(sys.argv[1]), 1, 2, key=bytes.fromhex(sys.argv[2]), timeout_s=30.0)
g._group()  # joined; then hangs like a server stuck mid-broadcast until it is killed
print("joined", flush=True)
time.sleep(600)
"""


def test_a_member_killed_mid_broadcast_cannot_hang_the_learner(tmp_path):
    port = free_port()
    sender = WeightGroup("127.0.0.1", port, 0, 2, key=KEY, timeout_s=5.0)
    proc = subprocess.Popen([sys.executable, "-c", MEMBER, str(port), KEY.hex()], stdout=subprocess.PIPE, text=True,
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
    LyingLearner("127.0.0.1", port, 0, 2, key=KEY, timeout_s=20.0).send(tensors)
    threads[0].join(30)
    assert got[1] is None
    assert len(errors) == 1 and isinstance(errors[0], BroadcastFailed) and "digest" in str(errors[0])


def _non_loopback_address() -> str | None:
    """An IPv4 address of this machine other than loopback (a second interface), if it has one."""
    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def _listening() -> set[tuple[str, int]]:
    import psutil

    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}


@pytest.mark.skipif(_non_loopback_address() is None, reason="this machine has no address but loopback")
def test_the_learners_store_and_sockets_listen_on_its_broadcast_host_alone():
    other, before = _non_loopback_address(), _listening()
    port, tensors = free_port(), _tensors()
    sender = WeightGroup("127.0.0.1", port, 0, 2, key=KEY, timeout_s=20.0)
    with pytest.raises(ConnectionRefusedError):  # the store, from this machine's other interface
        socket.create_connection((other, sender.port), timeout=5).close()
    got, errors, threads = _run_members(port, 2)
    sender.send(tensors)
    threads[0].join(30)
    assert not errors, errors
    opened = _listening() - before  # the store, and the gloo sockets of the learner and its member
    assert len(opened) >= 2 and {ip for ip, _ in opened} == {"127.0.0.1"}, opened


INTRUDER = """
import sys
from datetime import timedelta
import torch
import torch.distributed as dist
port, name, nbytes = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
timeout = timedelta(seconds=10)
store = dist.PrefixStore(f"tandem/{name}", dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout))
print("connected", flush=True)
try:  # takes rank 1's seat as a member would, without the run's token
    group = dist.ProcessGroupGloo(store, 1, 2, timeout)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buf], options).wait()
    print("received", flush=True)
except RuntimeError as e:
    print("refused:", str(e).splitlines()[0], flush=True)
"""


@pytest.mark.slow
def test_a_process_without_the_token_is_refused_and_the_learner_goes_on_with_its_members():
    port, tensors = free_port(), _tensors()
    sender = WeightGroup("127.0.0.1", port, 0, 2, key=KEY, timeout_s=20.0, name="v1")
    first_bucket = layout(manifest(tensors))[0].size
    intruder = subprocess.Popen([sys.executable, "-c", INTRUDER, str(port), "v1", str(first_bucket)],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert intruder.stdout.readline().strip() == "connected"
        time.sleep(1.0)  # it has written rank 1's address before the learner forms the group
        sent: list = []
        learner = threading.Thread(target=lambda: sent.append(sender.send(tensors)), daemon=True)
        learner.start()
        time.sleep(1.0)
        got = [None, None]

        def member() -> None:
            got[1] = WeightGroup("127.0.0.1", port, 1, 2, key=KEY, timeout_s=20.0, name="v1").receive()

        joined = threading.Thread(target=member, daemon=True)
        joined.start()
        joined.join(40)
        learner.join(40)
        said = intruder.communicate(timeout=40)[0]  # refused, or ended by gloo on the signed address it read
    finally:
        intruder.kill()
        intruder.wait()
    assert "received" not in said, f"a process without the token got the weights: {said!r}"
    assert sent and got[1] is not None and got[1][1] == sent[0]
    for name, t in tensors.items():
        assert torch.equal(got[1][0][name], t), name
