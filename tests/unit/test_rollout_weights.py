"""Weight-version checksums and checkpoint checks, without an engine."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys

import pytest

from services import weightstore


def _safetensors(path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A syntactically valid safetensors file with zero-filled data."""
    header, offset = {}, 0
    size = {"F32": 4, "BF16": 2}
    for name, (dtype, shape) in tensors.items():
        n = size[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def test_digest_is_sha256_of_safetensors_bytes_in_name_order(tmp_path):
    (tmp_path / "b.safetensors").write_bytes(b"second")
    (tmp_path / "a.safetensors").write_bytes(b"first")
    (tmp_path / "tandem-version.json").write_text("{}")  # not covered
    (tmp_path / "config.json").write_text("{}")  # not covered
    assert weightstore.digest(tmp_path) == hashlib.sha256(b"firstsecond").hexdigest()
    assert weightstore.digest(tmp_path / "a.safetensors") == hashlib.sha256(b"first").hexdigest()
    assert weightstore.total_bytes(tmp_path) == len(b"firstsecond")


def test_digest_agrees_with_the_learner_writer(tmp_path):
    learner_weights = pytest.importorskip("learner.weights")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    assert weightstore.digest(tmp_path) == learner_weights.digest(tmp_path)


def test_verify(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    weightstore.verify(tmp_path, hashlib.sha256(b"weights").hexdigest())
    with pytest.raises(weightstore.WeightStoreError, match="checksum mismatch"):
        weightstore.verify(tmp_path, "0" * 64)
    with pytest.raises(weightstore.WeightStoreError, match="no weights"):
        weightstore.verify(tmp_path / "missing", "0" * 64)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(weightstore.WeightStoreError, match="no"):
        weightstore.verify(empty, "0" * 64)


@pytest.mark.parametrize(
    ("uri", "path"),
    [("/data/v1", "/data/v1"), ("file:///data/v%201", "/data/v 1"), ("file://localhost/x", "/x"), ("rel/v1", "rel/v1")],
)
def test_uri_to_path(uri, path):
    assert str(weightstore.uri_to_path(uri)) == path


@pytest.mark.parametrize("uri", ["s3://bucket/v1", "file://otherhost/v1", "nccl://group"])
def test_uri_to_path_refuses_other_schemes(uri):
    with pytest.raises(weightstore.WeightStoreError):
        weightstore.uri_to_path(uri)


def test_weightstore_is_light():
    code = "import sys, services.weightstore\nassert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_rollout_package_imports_without_vllm():
    code = (
        "import sys, rollout_server, rollout_server.app, rollout_server.actor, rollout_server.transports\n"
        "heavy = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- checkpoint checks before the engine sees a version ---------------------------------

SIG = {"model.embed_tokens.weight": ("F32", [10, 4]), "model.norm.weight": ("F32", [4])}


async def _prepare(tmp_path, name, tensors=SIG, *, sha=None, mutate=None):
    from rollout_server.transports import FilesystemTransport, WeightLoadError  # noqa: F401
    from services.wire import LoadWeights

    d = tmp_path / name
    d.mkdir()
    _safetensors(d / "model.safetensors", tensors)
    if mutate:
        mutate(d / "model.safetensors")
    transport = FilesystemTransport({k: tuple(v[1]) for k, v in SIG.items()})
    return await transport.prepare(LoadWeights(version=1, uri=d.as_uri(), sha256=sha))


async def test_prepare_accepts_a_fitting_checkpoint_and_reports_its_size(tmp_path):
    prepared = await _prepare(tmp_path, "ok")
    assert prepared.bytes == (tmp_path / "ok" / "model.safetensors").stat().st_size
    # a dtype different from the served one is fine: vLLM converts on load
    await _prepare(tmp_path, "bf16", {k: ("BF16", v[1]) for k, v in SIG.items()})
    # so is an explicit lm_head next to tied embeddings
    await _prepare(tmp_path, "head", {**SIG, "lm_head.weight": ("F32", [10, 4])})


@pytest.mark.parametrize(
    ("tensors", "mutate", "message"),
    [
        ({"model.embed_tokens.weight": ("F32", [10, 4])}, None, "missing tensors"),
        ({**SIG, "model.extra.weight": ("F32", [2])}, None, "unexpected tensors"),
        ({**SIG, "model.norm.weight": ("F32", [5])}, None, "shape mismatch"),
        (SIG, lambda p: p.write_bytes(p.read_bytes()[:-8]), "beyond the end"),
        (SIG, lambda p: p.write_bytes(b"\xff" * 4), "not a safetensors"),
        (SIG, lambda p: p.write_bytes(struct.pack("<Q", 6) + b"{oops}"), "corrupt"),
    ],
)
async def test_prepare_refuses_unfit_or_corrupt_checkpoints(tmp_path, tensors, mutate, message):
    from rollout_server.transports import WeightLoadError

    with pytest.raises(WeightLoadError, match=message) as e:
        await _prepare(tmp_path, "bad", tensors, mutate=mutate)
    assert e.value.status == 422


async def test_prepare_checks_the_checksum_and_missing_dirs(tmp_path):
    from rollout_server.transports import FilesystemTransport, WeightLoadError
    from services.wire import LoadWeights

    with pytest.raises(WeightLoadError, match="checksum") as e:
        await _prepare(tmp_path, "sha", sha="0" * 64)
    assert e.value.status == 422
    t = FilesystemTransport({})
    with pytest.raises(WeightLoadError) as e:
        await t.prepare(LoadWeights(version=1, uri=str(tmp_path / "absent")))
    assert e.value.status == 404
