"""The filesystem transport's checks before the engine sees a version, without an engine.

The format itself (checksum, layout, headers) is tested in tests/unit/services/test_weightstore.py;
here the versions are written by the publish writer (services.weightstore) and the transport decides.
"""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest


def test_rollout_package_imports_without_vllm():
    code = (
        "import sys, rollout_server, rollout_server.app, rollout_server.actor, rollout_server.transports\n"
        "heavy = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- checkpoint checks before the engine sees a version ---------------------------------

SIG = {"model.embed_tokens.weight": ("F32", [10, 4]), "model.norm.weight": ("F32", [4])}


async def _prepare(tmp_path, name, tensors=SIG, *, sha="written", mutate=None):
    """Write a version with the publish writer, maybe damage it, and prepare it.

    ``sha``: the checksum sent; "written" for the one the writer returned.
    """
    import torch

    from rollout_server.transports import FilesystemTransport
    from services import weightstore as store
    from services.wire import LoadWeights

    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16}
    written = store.write_version(tmp_path / name, 1, {k: torch.zeros(shape, dtype=dtypes[dtype])
                                                       for k, (dtype, shape) in tensors.items()})
    if mutate:
        mutate(written.path / store.WEIGHTS_FILE)
    transport = FilesystemTransport({k: tuple(v[1]) for k, v in SIG.items()})
    prepared = await transport.prepare(LoadWeights(version=1, uri=written.path.as_uri(),
                                                   sha256=written.sha256 if sha == "written" else sha))
    assert prepared.location == written.path
    return prepared


async def test_prepare_accepts_a_fitting_checkpoint_and_reports_its_size(tmp_path):
    prepared = await _prepare(tmp_path, "ok")
    assert prepared.bytes == (tmp_path / "ok" / "v00000001" / "model.safetensors").stat().st_size
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
        (SIG, lambda p: p.write_bytes(p.read_bytes()[:-8]), "not a valid safetensors file.*incomplete"),
        (SIG, lambda p: p.write_bytes(b"\xff" * 4), "not a valid safetensors file.*too small"),
        (SIG, lambda p: p.write_bytes(struct.pack("<Q", 6) + b"{oops}"), "not a valid safetensors file.*JSON"),
    ],
)
async def test_prepare_refuses_unfit_or_corrupt_checkpoints(tmp_path, tensors, mutate, message):
    from rollout_server.transports import WeightLoadError

    with pytest.raises(WeightLoadError, match=message) as e:
        # no checksum sent (a mutated file would fail it first): the header check catches it
        await _prepare(tmp_path, "bad", tensors, mutate=mutate, sha=None)
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
    (tmp_path / "no-weights").mkdir()
    with pytest.raises(WeightLoadError, match=r"no \*\.safetensors files") as e:
        await t.prepare(LoadWeights(version=1, uri=str(tmp_path / "no-weights")))
    assert e.value.status == 422


async def test_prepare_refuses_a_head_unlike_its_tied_embedding(tmp_path):
    """The served model's checkpoint has no lm_head.weight (its head is tied to its embeddings): a version whose
    lm_head.weight differs from its embedding is what a LoRA on a tied head publishes, and vLLM would serve one
    tensor as both. An lm_head.weight equal to the embedding is harmless (test above)."""
    import torch

    from rollout_server.transports import FilesystemTransport, WeightLoadError
    from services import weightstore as store
    from services.wire import LoadWeights

    embed = torch.zeros(10, 4)
    written = store.write_version(tmp_path, 1, {"model.embed_tokens.weight": embed, "model.norm.weight": torch.zeros(4),
                                                "lm_head.weight": embed + 0.5})
    transport = FilesystemTransport({k: tuple(v[1]) for k, v in SIG.items()})
    with pytest.raises(WeightLoadError, match="lm_head.weight unlike its model.embed_tokens.weight") as e:
        await transport.prepare(LoadWeights(version=1, uri=written.path.as_uri(), sha256=written.sha256))
    assert e.value.status == 422
