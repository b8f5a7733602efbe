"""A weight version streamed in memory: the learner's rank 0 to the rollout servers' vLLM workers.

``publish.transport = "broadcast"``. One group per version, over torch.distributed
(gloo here, on CPU; NCCL is the same calls on GPUs): the learner is rank 0 and
the TCPStore's host; each vLLM worker of each server that joined is one of the
ranks ``1 .. world - 1``. The group lives outside vLLM's and DeepSpeed's own
process groups (a ``ProcessGroupGloo`` on a ``TCPStore`` of its own, never the
default group), so joining it disturbs neither.

What travels, in order:

1. the **manifest** (``store["manifest"]``, JSON, set before the group forms):
   each tensor's name, dtype and shape in the order the learner sends them. A
   server checks it against the model it serves before touching the engine
   (``rollout_server.transports.BroadcastTransport.prepare``);
2. the tensors, packed into **buckets** of about ``bucket_bytes`` (:func:`layout`:
   a tensor never spans two buckets, each starts 16-byte aligned so the receiver
   can view it in place), one ``broadcast`` per bucket;
3. the **digest** (``store["digest"]``): SHA-256 over the manifest and every
   bucket's bytes, which the learner computes while sending and each worker
   computes while receiving. A worker loads nothing whose digest differs.

A member that never joins or dies half way costs the learner at most
``timeout_s`` per wait (the gloo timeout of the rendezvous and of each bucket);
then :meth:`WeightGroup.send` raises :class:`BroadcastFailed` and the learner
carries on with the version's files.

Who may join: the learner's store and gloo sockets listen on its broadcast host only (torch's
``TCPStore`` would bind every interface, so rank 0 binds the socket itself and hands it over), and
every value in the store (the manifest, the digest, gloo's addresses of the ranks) is signed with a
key derived from the run's token (:func:`broadcast_key`, ``SignedStore``). A process without
the token that writes a rank's address, a manifest or a digest is ignored: the learner and the
members wait for a signed value, and a member refuses unsigned bytes; at worst the group fails and
everyone carries on with the files. What it does not stop is in docs/security.md.

torch is imported inside the functions: this module is imported by
``rollout_server.worker_ext`` in vLLM's workers and by the learner, never by
the light modules.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pydantic import SecretStr

BUCKET_BYTES = 64 << 20
"""Bytes per broadcast call: large enough that per-call latency is small against the copy, small enough
that the packing buffer is a small fraction of the model."""
ALIGN = 16


class BroadcastFailed(Exception):
    """The group did not form or a member stopped answering within the timeout."""


def broadcast_key(token: SecretStr | None) -> bytes:
    """The key that signs a run's weight groups, derived from the services' token (``TANDEM_TOKEN``,
    which the learner and the rollout servers share). Without a token (auth off, loopback only) the key
    is public: anyone on the machine may join."""
    secret = "" if token is None else token.get_secret_value()
    return hmac.new(secret.encode(), b"tandem weight broadcast", hashlib.sha256).digest()


@functools.cache
def _signed_store_class():
    import torch.distributed as dist

    class SignedStore(dist.Store):
        """A store whose values carry an HMAC of (group, key, value) under the run's broadcast key.

        :meth:`get` waits, up to the timeout, for a value signed with the key: an unsigned one (a process
        without the token wrote it, or wrote it first) is skipped, a signed one written after it is read.
        Counters (:meth:`add`) are not signed: a forged count can only end a group early."""

        def __init__(self, inner, key: bytes, group: str, timeout: timedelta) -> None:
            super().__init__()
            self.inner, self.key, self.group, self.timeout_s = inner, key, group.encode(), timeout.total_seconds()

        def _mac(self, name: str, value: bytes) -> bytes:
            return hmac.new(self.key, b"\0".join([self.group, name.encode(), value]), hashlib.sha256).digest()

        def set(self, name: str, value) -> None:
            value = value.encode() if isinstance(value, str) else bytes(value)
            self.inner.set(name, self._mac(name, value) + value)

        def get(self, name: str) -> bytes:
            deadline = time.monotonic() + self.timeout_s
            while True:
                raw = self.inner.get(name)  # waits for the key (the inner store's timeout)
                mac, value = raw[:32], raw[32:]
                if hmac.compare_digest(mac, self._mac(name, value)):
                    return value
                if time.monotonic() > deadline:
                    raise RuntimeError(f"weight group key {name!r} is not signed with the run's token: "
                                       "a process without TANDEM_TOKEN wrote it")
                time.sleep(0.05)

        def multi_get(self, names: list[str]) -> list[bytes]:
            return [self.get(n) for n in names]

        def multi_set(self, names: list[str], values: list) -> None:
            for n, v in zip(names, values, strict=True):
                self.set(n, v)

        def wait(self, names: list[str], timeout: timedelta | None = None) -> None:
            self.inner.wait(names) if timeout is None else self.inner.wait(names, timeout)

        def check(self, names: list[str]) -> bool:
            return self.inner.check(names)

        def add(self, name: str, amount: int) -> int:
            return self.inner.add(name, amount)

        def delete_key(self, name: str) -> bool:
            return self.inner.delete_key(name)

        def num_keys(self) -> int:
            return self.inner.num_keys()

    return SignedStore


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host`` alone (``port`` 0: a free one)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own store socket
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def _local_address(host: str) -> str:
    """This machine's address that routes to ``host`` (a member's gloo sockets listen there: on the
    interface the learner reaches, 127.0.0.1 for a learner on loopback). No packet is sent."""
    family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def _store(host: str, port: int, world: int | None, master: bool, timeout: timedelta):
    """The group's TCPStore: rank 0 hosts it on ``host`` alone, the others connect to it."""
    import torch.distributed as dist

    if not master:
        return dist.TCPStore(host, port, world, False, timeout=timeout)
    sock = _listen(host, port)
    port, fd = sock.getsockname()[1], sock.detach()  # the store owns the descriptor from here on
    try:
        return dist.TCPStore(host, port, world, True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


@dataclass(frozen=True)
class Entry:
    """One tensor of the manifest."""

    name: str
    dtype: str  # torch dtype name without the prefix: "float32", "bfloat16"
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    size: int
    entries: tuple[tuple[int, int], ...]  # (index in the manifest, byte offset in the bucket)


def manifest(tensors: Mapping[str, Any]) -> list[Entry]:
    return [Entry(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())
            for name, t in tensors.items()]


def encode(entries: list[Entry]) -> bytes:
    return json.dumps([[e.name, e.dtype, list(e.shape), e.nbytes] for e in entries]).encode()


def decode(raw: bytes) -> list[Entry]:
    return [Entry(n, d, tuple(s), b) for n, d, s, b in json.loads(raw)]


def signature(entries: list[Entry]) -> dict[str, tuple[int, ...]]:
    """Names and shapes, as ``services.weightstore.checkpoint_signature`` gives them for a file."""
    return {e.name: e.shape for e in entries}


def layout(entries: list[Entry], bucket_bytes: int = BUCKET_BYTES) -> list[Bucket]:
    """Consecutive tensors packed into buckets of at most ``bucket_bytes`` (a larger tensor alone in one)."""
    buckets: list[Bucket] = []
    current: list[tuple[int, int]] = []
    size = 0
    for i, e in enumerate(entries):
        offset = -(-size // ALIGN) * ALIGN
        if current and offset + e.nbytes > bucket_bytes:
            buckets.append(Bucket(size, tuple(current)))
            current, offset = [], 0
        current.append((i, offset))
        size = offset + e.nbytes
    if current:
        buckets.append(Bucket(size, tuple(current)))
    return buckets


class WeightGroup:
    """One version's group, seen from one rank. Rank 0 (the learner) hosts the store and sends;
    the others receive. ``name`` keeps the keys of two versions on one port apart; ``key``
    (:func:`broadcast_key`) signs and checks every value of the store."""

    def __init__(self, host: str, port: int, rank: int, world: int, *, key: bytes, timeout_s: float,
                 name: str = "v") -> None:
        import torch.distributed as dist

        self.rank, self.world, self.timeout = rank, world, timedelta(seconds=timeout_s)
        try:
            store = _store(host, port, world, rank == 0, self.timeout)
            # gloo's own sockets: the learner's on its broadcast host, a member's on its address towards it
            self._device = dist.ProcessGroupGloo.create_device(hostname=host if rank == 0 else _local_address(host))
        except (RuntimeError, OSError) as e:  # DistStoreError is a RuntimeError
            raise BroadcastFailed(f"weight group store {host}:{port}: {e}") from e
        self.port = store.port  # rank 0 may pass port 0: the system picks a free one, no race for it
        self.store = _signed_store_class()(dist.PrefixStore(f"tandem/{name}", store), key, name, self.timeout)
        self._tcp = store  # the members read the digest from it after the last bucket: it lives as long as this
        self._pg = None

    def _group(self):
        import torch.distributed as dist

        if self._pg is None:
            options = dist.ProcessGroupGloo._Options()
            options._timeout, options._devices = self.timeout, [self._device]
            try:
                self._pg = dist.ProcessGroupGloo(self.store, self.rank, self.world, options)
            except RuntimeError as e:
                raise BroadcastFailed(f"weight group of {self.world} did not form: {e}") from e
        return self._pg

    def _broadcast(self, buf) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            self._group().broadcast([buf], opts).wait(self.timeout)
        except RuntimeError as e:
            what = f"broadcast to {self.world - 1} member(s)" if self.rank == 0 else "broadcast from the learner"
            raise BroadcastFailed(f"{what} failed: {e}") from e

    def send(self, tensors: Mapping[str, Any], bucket_bytes: int = BUCKET_BYTES) -> str:
        """Rank 0: stream ``tensors`` to every member; return the digest (also left in the store)."""
        import torch

        entries = manifest(tensors)
        raw = encode(entries)
        self.store.set("bucket_bytes", str(bucket_bytes))
        self.store.set("manifest", raw)
        h = hashlib.sha256(raw)
        values = list(tensors.values())
        for bucket in layout(entries, bucket_bytes):
            buf = torch.zeros(bucket.size, dtype=torch.uint8)
            for i, offset in bucket.entries:
                flat = values[i].detach().contiguous().view(-1).view(torch.uint8)
                buf[offset:offset + flat.numel()].copy_(flat)
            self._broadcast(buf)
            h.update(buf.numpy())
        digest = h.hexdigest()
        self._announce_digest(digest)
        self._wait_members()
        return digest

    def _wait_members(self) -> None:
        """Until every member has read the digest (and checked it), within the timeout: only then may the
        store go away."""

        deadline = time.monotonic() + self.timeout.total_seconds()
        while self.store.add("done", 0) < self.world - 1:
            if time.monotonic() > deadline:
                raise BroadcastFailed(f"{self.world - 1 - self.store.add('done', 0)} member(s) never confirmed "
                                      f"the digest within {self.timeout.total_seconds():g} s")
            time.sleep(0.005)

    def _announce_digest(self, digest: str) -> None:
        self.store.set("digest", digest)

    def receive(self) -> tuple[dict[str, Any], str]:
        """A member: the tensors (views into the received buckets), after checking the digest."""
        import torch

        try:
            raw = self.store.get("manifest")
            bucket_bytes = int(self.store.get("bucket_bytes"))
        except RuntimeError as e:
            raise BroadcastFailed(f"no manifest from the learner: {e}") from e
        entries = decode(raw)
        h = hashlib.sha256(raw)
        out: dict[str, Any] = {}
        for bucket in layout(entries, bucket_bytes):
            buf = torch.empty(bucket.size, dtype=torch.uint8)
            self._broadcast(buf)
            h.update(buf.numpy())
            for i, offset in bucket.entries:
                e = entries[i]
                out[e.name] = buf[offset:offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
        digest = h.hexdigest()
        try:
            expected = self.store.get("digest").decode()
        finally:
            self.store.add("done", 1)
        if digest != expected:
            raise BroadcastFailed(f"received weights have digest {digest}, the learner sent {expected}")
        return out, digest


def read_manifest(host: str, port: int, *, key: bytes, timeout_s: float, name: str = "v") -> list[Entry]:
    """The manifest of a group, read as a client of its store without joining (to check it first)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, None, False, timeout=timeout)
        return decode(_signed_store_class()(dist.PrefixStore(f"tandem/{name}", store), key, name, timeout).get("manifest"))
    except RuntimeError as e:
        raise BroadcastFailed(f"weight group store {host}:{port}: {e}") from e


# -- invitations: how a rollout server is told to join ------------------------

SCHEME = "broadcast://"


@dataclass(frozen=True)
class Invitation:
    """One server's seat in one version's group: the URI of a ``LoadWeights`` the engine loads through
    ``rollout_server.transports.BroadcastTransport`` (``broadcast://host:port/group?rank=R&world=W&timeout=T``;
    ``rank`` is the server's first rank, its vLLM workers take ``rank .. rank + workers - 1``)."""

    host: str
    port: int
    group: str
    rank: int
    world: int
    timeout_s: float

    @property
    def uri(self) -> str:
        return (f"{SCHEME}{self.host}:{self.port}/{self.group}"
                f"?rank={self.rank}&world={self.world}&timeout={self.timeout_s:g}")

    @classmethod
    def parse(cls, uri: str) -> Invitation:
        from urllib.parse import parse_qs, urlsplit

        if not uri.startswith(SCHEME):
            raise ValueError(f"not a {SCHEME} URI: {uri!r}")
        u = urlsplit(uri)
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        try:
            inv = cls(u.hostname or "", int(u.port or 0), u.path.strip("/"), int(q["rank"]), int(q["world"]),
                      float(q["timeout"]))
        except (KeyError, ValueError) as e:
            raise ValueError(f"malformed {SCHEME} URI {uri!r}: {e}") from e
        if not inv.host or not inv.port or not inv.group or not 0 < inv.rank < inv.world or inv.timeout_s <= 0:
            raise ValueError(f"malformed {SCHEME} URI {uri!r}")
        return inv
