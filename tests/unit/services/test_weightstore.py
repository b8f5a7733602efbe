"""The weight-store format (services.weightstore): layout, checksum, record, writing and reading."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from services import weightstore as ws


def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(7, 3, generator=g),
        "model.norm.weight": torch.randn(3, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(3, 5, generator=g).t(),  # not contiguous
        "scalar": torch.tensor(2.5),
        "ids": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


# -- the checksum -----------------------------------------------------------------------


def test_digest_is_sha256_of_safetensors_bytes_in_name_order(tmp_path):
    (tmp_path / "b.safetensors").write_bytes(b"second")
    (tmp_path / "a.safetensors").write_bytes(b"first")
    (tmp_path / "tandem-version.json").write_text("{}")  # not covered
    (tmp_path / "config.json").write_text("{}")  # not covered
    assert ws.digest(tmp_path) == hashlib.sha256(b"firstsecond").hexdigest()
    assert ws.digest(tmp_path / "a.safetensors") == hashlib.sha256(b"first").hexdigest()
    assert ws.total_bytes(tmp_path) == len(b"firstsecond")


def test_digest_reads_files_larger_than_its_buffer(tmp_path):
    data = bytes(range(256)) * ((ws._CHUNK * 2 + 12345) // 256)
    (tmp_path / "model.safetensors").write_bytes(data)
    assert ws.digest(tmp_path) == hashlib.sha256(data).hexdigest()


def test_verify(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    ws.verify(tmp_path, hashlib.sha256(b"weights").hexdigest())
    with pytest.raises(ws.WeightStoreError, match="checksum mismatch"):
        ws.verify(tmp_path, "0" * 64)
    with pytest.raises(ws.WeightStoreError, match="no weights"):
        ws.verify(tmp_path / "missing", "0" * 64)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ws.WeightStoreError, match="no"):
        ws.verify(empty, "0" * 64)


@pytest.mark.parametrize(
    ("uri", "path"),
    [("/data/v1", "/data/v1"), ("file:///data/v%201", "/data/v 1"), ("file://localhost/x", "/x"), ("rel/v1", "rel/v1")],
)
def test_uri_to_path(uri, path):
    assert str(ws.uri_to_path(uri)) == path


@pytest.mark.parametrize("uri", ["s3://bucket/v1", "file://otherhost/v1", "nccl://group"])
def test_uri_to_path_refuses_other_schemes(uri):
    with pytest.raises(ws.WeightStoreError):
        ws.uri_to_path(uri)


def test_weightstore_is_light():
    code = (
        "import sys, services.weightstore\n"
        "heavy = [m for m in ('torch', 'numpy', 'safetensors') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- layout -----------------------------------------------------------------------------


def test_version_directories_are_named_and_parsed_one_way(tmp_path):
    d = ws.version_dir(tmp_path, 42)
    assert d == tmp_path / "v00000042" and ws.parse_version_dir(d) == 42
    for name in ("v42", "v0000004x", ".v00000042.tmp-7", "x00000042", "v000000042"):
        assert ws.parse_version_dir(tmp_path / name) is None, name
    (tmp_path / "v00000003").mkdir()
    d.mkdir()
    (tmp_path / "v00000005").write_text("a file, not a version")
    (tmp_path / "other").mkdir()
    assert ws.on_disk(tmp_path) == [3, 42]
    ws.delete_version(tmp_path, 3)
    assert ws.on_disk(tmp_path) == [42]
    assert ws.on_disk(tmp_path / "absent") == []


# -- writing ----------------------------------------------------------------------------


def test_a_written_version_is_standard_safetensors_with_its_sha256_and_record(tmp_path):
    ts = tensors()
    w = ws.write_version(tmp_path, 3, ts, step=6)
    assert w.path == ws.version_dir(tmp_path, 3) and w.version == 3
    f = w.path / ws.WEIGHTS_FILE
    loaded = load_file(f)
    assert set(loaded) == set(ts)
    for k, v in ts.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
    raw = f.read_bytes()
    assert w.sha256 == hashlib.sha256(raw).hexdigest() == ws.digest(w.path)
    assert w.bytes == len(raw) == ws.total_bytes(w.path)
    ws.verify(w.path, w.sha256)
    with safe_open(f, "pt") as st:
        assert st.metadata() == {"format": "pt", "tandem_version": "3", "tandem_step": "6"}
    record = ws.read_record(w.path)
    assert (record.version, record.step, record.sha256, record.bytes, record.format) == (3, 6, w.sha256, w.bytes, "full")
    assert json.loads((w.path / ws.META_FILE).read_text())["sha256"] == w.sha256
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000003"]  # no temp directory left


def test_versions_are_not_overwritten_unless_asked(tmp_path):
    ws.write_version(tmp_path, 1, tensors())
    with pytest.raises(FileExistsError):
        ws.write_version(tmp_path, 1, tensors())
    w = ws.write_version(tmp_path, 1, {"x": torch.ones(2)}, replace=True)
    assert set(load_file(w.path / ws.WEIGHTS_FILE)) == {"x"}


def test_half_written_versions_are_invisible_and_cleaned(tmp_path):
    ws.write_version(tmp_path, 1, tensors())
    (tmp_path / ".v00000002.tmp-999").mkdir()  # a writer killed mid-write leaves this
    assert ws.on_disk(tmp_path) == [1]
    assert ws.clean_temp(tmp_path) == 1
    assert not (tmp_path / ".v00000002.tmp-999").exists()
    assert ws.on_disk(tmp_path) == [1]


def test_a_failed_write_leaves_neither_version_nor_temp(tmp_path):
    w = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="share memory"):  # an untied copy of a tied head
        ws.write_version(tmp_path, 1, {"model.embed_tokens.weight": w, "lm_head.weight": w})
    assert list(tmp_path.iterdir()) == []


def test_the_adapter_layout_shares_the_scheme(tmp_path):
    w = ws.write_version(tmp_path, 2, {"base_model.model.lora_A.weight": torch.ones(2, 4)},
                         weights_name="adapter_model.safetensors", extra_files={"adapter_config.json": '{"r": 2}'})
    assert sorted(p.name for p in w.path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", ws.META_FILE]
    assert w.sha256 == hashlib.sha256((w.path / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert ws.read_record(w.path).format == "peft-adapter"
    assert json.loads((w.path / "adapter_config.json").read_text()) == {"r": 2}


# -- reading ----------------------------------------------------------------------------


def test_headers_and_signatures_are_read_without_loading(tmp_path):
    ws.write_safetensors(tmp_path / "model-00001-of-00002.safetensors",
                         {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}, {"k": "v"})
    ws.write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"c": torch.zeros((), dtype=torch.int64)})
    header = ws.read_header(tmp_path / "model-00001-of-00002.safetensors")
    assert header.tensors == {"a": ("F32", (2, 3)), "b": ("BF16", (4,))}
    assert header.metadata == {"k": "v"}
    assert ws.checkpoint_signature(tmp_path) == {"a": (2, 3), "b": (4,), "c": ()}
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ws.WeightStoreError, match="no"):
        ws.checkpoint_signature(empty)


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda b: b[:-8], "incomplete metadata"),  # a truncated copy
        (lambda b: b + b"\0" * 8, "incomplete metadata"),  # more data than the header says
        (lambda b: b"\xff" * 4, "header too small"),
        (lambda b: struct.pack("<Q", 6) + b"{oops}", "invalid JSON"),
        (lambda b: struct.pack("<Q", 1 << 40) + b"{}", "header too large"),
    ],
)
def test_malformed_files_are_refused_with_the_reason(tmp_path, mutate, reason):
    f = tmp_path / "model.safetensors"
    ws.write_safetensors(f, {"a": torch.zeros(2, 3)})
    ws.read_header(f)
    f.write_bytes(mutate(f.read_bytes()))
    with pytest.raises(ws.WeightStoreError, match=f"model.safetensors: not a valid safetensors file: .*{reason}"):
        ws.read_header(f)
    with pytest.raises(ws.WeightStoreError, match=reason):
        ws.checkpoint_signature(tmp_path)


def test_an_unreadable_record_is_a_weightstore_error(tmp_path):
    with pytest.raises(ws.WeightStoreError, match="version record"):
        ws.read_record(tmp_path)
    (tmp_path / ws.META_FILE).write_text('{"version": 1}')
    with pytest.raises(ws.WeightStoreError, match="version record"):
        ws.read_record(tmp_path)
