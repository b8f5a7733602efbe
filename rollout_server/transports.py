"""How a published weight version gets into the engine: the transport seam.

A load has two halves, so that slow I/O never stalls generation:

1. :meth:`WeightTransport.prepare` runs while the engine keeps generating:
   find the weights, verify the checksum, check that they fit the model.
   Anything wrong here is a :class:`WeightLoadError` and the engine was never
   touched: the old weights keep serving.
2. :meth:`WeightTransport.apply` runs while the engine is paused (see
   ``reload.WeightReloads.load_weights``): it moves the prepared weights into the
   engine in place.

:class:`FilesystemTransport` handles paths and ``file://`` URIs (a directory
of safetensors per version: local disk, a docker-compose volume, a Modal
Volume); the format of that directory, its checksum and the reading of its
headers belong to ``services.weightstore``, which the learner writes it with.
:class:`BroadcastTransport` handles ``broadcast://`` URIs: the server's seat in
one version's in-memory weight group (``publish.transport = "broadcast"``;
``services.weightgroup``), ``prepare`` checking the learner's manifest and
``apply`` receiving the tensors in every vLLM worker. The actor loop and the
HTTP API only ever call ``RolloutEngine.load_weights(LoadWeights)``, which
picks the transport by URI scheme, so adding one touches neither.

:func:`confine` is what ``POST /v1/weights`` asks before any of this: the
path of a version named over HTTP, resolved, must lie under the weight
store's root (the run directory), its weight files included, so a caller
cannot make the engine read an arbitrary readable directory or a symlink out
of the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from services import watchdog, weightgroup, weightstore
from services.weightstore import checkpoint_signature
from services.wire import LoadWeights

PREPARE_THREAD = "tandem-weights-prepare"
"""Name of the threads that read and verify a version (their stacks go into a reload incident)."""


class WeightLoadError(Exception):
    """A weight version that cannot be loaded; ``status`` is the HTTP status it maps to."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Prepared:
    """Weights verified and ready to be applied."""

    request: LoadWeights
    location: Any
    bytes: int


class WeightTransport(Protocol):
    def accepts(self, uri: str) -> bool: ...

    async def prepare(self, request: LoadWeights) -> Prepared: ...

    async def apply(self, llm: Any, prepared: Prepared) -> None: ...


def confine(uri: str, root: Path) -> Path:
    """The resolved path ``uri`` names, if it and its weight files lie under ``root`` (resolved).

    Symlinks are followed before the check, so a link inside the store that
    points out of it is refused; the caller loads the resolved path, not the
    link. 422 for a URI that is not a local path, 403 for a path outside.
    """
    try:
        path = weightstore.uri_to_path(uri)
    except weightstore.WeightStoreError as e:
        raise WeightLoadError(422, f"uri: {e}") from e
    root = root.resolve()
    resolved = path.resolve()
    outside = [p for p in [resolved, *(resolved.glob(weightstore.WEIGHTS_GLOB) if resolved.is_dir() else [])]
               if not p.resolve().is_relative_to(root)]
    if outside:
        raise WeightLoadError(
            403, f"uri: {outside[0]} resolves to {outside[0].resolve()}, outside the weight store {root} "
                 "(TANDEM_RUN_DIR); a rollout server loads only versions under it"
        )
    return resolved


def fits(sig: dict[str, tuple[int, ...]], reference: dict[str, tuple[int, ...]], version: int) -> None:
    """422 unless a version's tensors (``sig``: names and shapes) are those of the served model."""
    missing = sorted(set(reference) - set(sig))
    # tied embeddings: a checkpoint may carry lm_head.weight or not (its values: tied_head_fits)
    extra = sorted(set(sig) - set(reference) - {TIED_HEAD})
    wrong = sorted(n for n in set(sig) & set(reference) if sig[n] != reference[n])
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing[:5]}")
        if extra:
            parts.append(f"unexpected tensors {extra[:5]}")
        if wrong:
            parts.append("shape mismatch " + ", ".join(f"{n}: {sig[n]} != {reference[n]}" for n in wrong[:5]))
        raise WeightLoadError(422, f"version {version} does not fit the served model: {'; '.join(parts)}")


TIED_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def tied_head_fits(path: Path, sig: dict[str, tuple[int, ...]], reference: dict[str, tuple[int, ...]],
                   version: int) -> None:
    """422 when a version for a model whose head is tied to its input embeddings (its checkpoint has no
    ``lm_head.weight``) carries an ``lm_head.weight`` that is not its embedding. vLLM ties the two to one
    tensor, so whichever it loads last would serve as both, and the engine would not be the learner's
    policy: what a LoRA on the head of a tied model publishes (the learner refuses that adapter)."""
    if TIED_HEAD not in sig or TIED_HEAD in reference:
        return
    import torch
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for f in weightstore.weight_files(path):
        with safe_open(f, "pt") as st:
            found.update((name, st.get_tensor(name)) for name in (TIED_HEAD, EMBEDDING) if name in st.keys())
    if EMBEDDING not in found or not torch.equal(found[TIED_HEAD], found[EMBEDDING]):
        raise WeightLoadError(422, f"version {version} carries an {TIED_HEAD} unlike its {EMBEDDING}, but the "
                                   "served model ties its head to its input embeddings (tie_word_embeddings): "
                                   "vLLM would serve one tensor as both (a LoRA on the head or the embedding of a "
                                   "tied model? learner.lora.target_modules)")


# -- filesystem ---------------------------------------------------------------


class LocalVersions:
    """What the transports of versions in local directories share: paths and ``file://`` URIs,
    checked in a thread of their own (:meth:`_prepare`, from the version's directory)."""

    def accepts(self, uri: str) -> bool:
        return "://" not in uri or uri.startswith("file://")

    async def prepare(self, request: LoadWeights) -> Prepared:
        # hashing gigabytes takes seconds: keep it off the event loop, in a thread of its own, so
        # that a read that never returns (a hung network filesystem) holds no shared executor slot
        # when the engine's reload bound abandons it
        return await watchdog.in_thread(self._prepare, request, name=PREPARE_THREAD)

    @staticmethod
    def path_of(request: LoadWeights) -> Path:
        """The directory ``request`` names; 422 when its URI is not a version under the run directory."""
        try:
            return weightstore.uri_to_path(request.uri)
        except weightstore.WeightStoreError as e:
            raise WeightLoadError(422, str(e)) from e

    def _prepare(self, request: LoadWeights) -> Prepared:
        raise NotImplementedError


class FilesystemTransport(LocalVersions):
    """Weights in a directory of safetensors, named by a path or ``file://`` URI.

    ``reference`` is the signature (tensor names and shapes) of the model the
    engine was started with; a version whose tensors differ is refused before
    the engine sees it (vLLM's in-place reload would otherwise fail half way,
    leaving some layers new and some old).
    """

    def __init__(self, reference: dict[str, tuple[int, ...]]) -> None:
        self.reference = reference

    def _prepare(self, request: LoadWeights) -> Prepared:
        path = self.path_of(request)
        if not path.is_dir():
            raise WeightLoadError(404, f"weights for version {request.version} not found: {path} is not a directory")
        try:
            if request.sha256 is not None:
                weightstore.verify(path, request.sha256)
            sig = checkpoint_signature(path)  # names and shapes, from the headers alone
            nbytes = weightstore.total_bytes(path)
        except weightstore.WeightStoreError as e:
            raise WeightLoadError(422, f"version {request.version}: {e}") from e
        except OSError as e:
            raise WeightLoadError(422, f"version {request.version}: unreadable weights: {e}") from e
        fits(sig, self.reference, request.version)
        tied_head_fits(path, sig, self.reference, request.version)
        return Prepared(request, path, nbytes)

    async def apply(self, llm: Any, prepared: Prepared) -> None:
        # vLLM's in-place reload (vllm.model_executor.model_loader.reload) loads the
        # checkpoint layer by layer into the existing parameters and re-runs the
        # platform's post-processing (the CPU backend repacks weights after loading,
        # which is why a raw model.load_weights does not work there). Called through
        # tandem's worker extension, which also refreshes a tied LM head (worker_ext).
        await llm.collective_rpc("tandem_reload_weights", kwargs={"weights_path": str(prepared.location)})


# -- broadcast ----------------------------------------------------------------


class BroadcastTransport:
    """Weights streamed by the learner (``publish.transport = "broadcast"``), named by a
    ``broadcast://`` URI: this server's seat in one version's group (``services.weightgroup``).

    ``prepare`` reads the group's manifest from the learner's store without joining and checks it
    against the served model (engine untouched, like a file's headers); ``apply`` runs while the engine
    is paused: every vLLM worker joins the group, receives the buckets, compares its digest with the
    learner's and only then loads the tensors in place (``worker_ext.tandem_receive_weights``). The
    version's files, written behind the broadcast, stay the way back for a server that misses one.
    ``key`` (``weightgroup.broadcast_key`` of the server's token) checks the learner's store and signs
    this server's part of it.
    """

    def __init__(self, reference: dict[str, tuple[int, ...]], key: bytes) -> None:
        self.reference = reference
        self.key = key

    def accepts(self, uri: str) -> bool:
        return uri.startswith(weightgroup.SCHEME)

    async def prepare(self, request: LoadWeights) -> Prepared:
        return await watchdog.in_thread(self._prepare, request, name=PREPARE_THREAD)

    def _prepare(self, request: LoadWeights) -> Prepared:
        try:
            seat = weightgroup.Invitation.parse(request.uri)
        except ValueError as e:
            raise WeightLoadError(422, str(e)) from e
        try:
            entries = weightgroup.read_manifest(seat.host, seat.port, key=self.key, timeout_s=seat.timeout_s,
                                                name=seat.group)
        except weightgroup.BroadcastFailed as e:
            raise WeightLoadError(503, f"version {request.version}: {e}") from e
        fits(weightgroup.signature(entries), self.reference, request.version)
        return Prepared(request, seat, sum(e.nbytes for e in entries))

    async def apply(self, llm: Any, prepared: Prepared) -> None:
        """Receive and load; a :class:`WeightLoadError` (503) when the group failed or the digest differed
        in some worker before anything was loaded (so no restore is needed: the old weights serve on)."""
        seat: weightgroup.Invitation = prepared.location
        why = await llm.collective_rpc("tandem_receive_weights", kwargs={
            "host": seat.host, "port": seat.port, "rank": seat.rank, "world": seat.world, "group": seat.group,
            "timeout_s": seat.timeout_s, "key": self.key.hex(),
        })
        failed = [w for w in why if w is not None]
        if failed and len(failed) < len(why):
            # some workers loaded, some did not: the tensor-parallel shards disagree; the engine restores
            raise RuntimeError(f"version {prepared.request.version} reached only some workers: {failed[0]}")
        if failed:
            raise WeightLoadError(503, f"version {prepared.request.version} not received: {failed[0]}")
