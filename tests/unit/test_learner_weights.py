"""The weight store writer (learner.weights): format, checksum, atomicity, retention."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from learner import weights as store


def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(7, 3, generator=g),
        "model.norm.weight": torch.randn(3, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "ids": torch.arange(5, dtype=torch.int64),
    }


def test_written_file_is_standard_safetensors_with_its_sha256(tmp_path):
    ts = tensors()
    w = store.write_version(tmp_path, 3, ts, step=6)
    assert w.path == tmp_path / "v00000003"
    loaded = load_file(w.path / store.WEIGHTS_FILE)
    assert set(loaded) == set(ts)
    for k, v in ts.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v)
    raw = (w.path / store.WEIGHTS_FILE).read_bytes()
    assert w.sha256 == hashlib.sha256(raw).hexdigest() == store.digest(w.path)
    assert w.bytes == len(raw)
    from services import weightstore  # the reader side's definition agrees

    weightstore.verify(w.path, w.sha256)
    assert weightstore.total_bytes(w.path) == w.bytes
    with safe_open(w.path / store.WEIGHTS_FILE, "pt") as f:
        assert f.metadata()["tandem_version"] == "3"
    meta = json.loads((w.path / store.META_FILE).read_text())
    assert meta["sha256"] == w.sha256 and meta["step"] == 6


def test_versions_are_not_overwritten_unless_asked(tmp_path):
    store.write_version(tmp_path, 1, tensors())
    with pytest.raises(FileExistsError):
        store.write_version(tmp_path, 1, tensors())
    w = store.write_version(tmp_path, 1, {"x": torch.ones(2)}, replace=True)
    assert set(load_file(w.path / store.WEIGHTS_FILE)) == {"x"}


def test_half_written_versions_are_invisible_and_cleaned(tmp_path):
    store.write_version(tmp_path, 1, tensors())
    (tmp_path / ".v00000002.tmp-999").mkdir()  # a writer killed mid-write leaves this
    assert store.on_disk(tmp_path) == [1]
    assert store.clean_temp(tmp_path) == 1
    assert not (tmp_path / ".v00000002.tmp-999").exists()


def test_retention_keeps_the_newest_and_versions_in_use():
    keep, delete = store.retained([1, 2, 3, 4, 5], keep=2, in_use=[2, 9])
    assert keep == {2, 4, 5} and delete == {1, 3}
