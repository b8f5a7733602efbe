"""host.files: a file replaced whole, with the permissions asked for, and nothing left behind on failure."""

from __future__ import annotations

import os
import stat

import pytest

from host.files import write_atomic


def test_replaces_the_file_whole_with_the_mode_asked_for(tmp_path):
    path = tmp_path / "stack.json"
    path.write_text("old")
    os.chmod(path, 0o644)
    write_atomic(path, '{"token": "secret"}', mode=0o600)
    assert path.read_text() == '{"token": "secret"}'
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # not the older file's 0644
    write_atomic(path, b"\x00bytes")
    assert path.read_bytes() == b"\x00bytes"
    assert os.listdir(tmp_path) == ["stack.json"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    target = tmp_path / "pointer"
    target.mkdir()  # rename onto a directory fails
    (target / "inside").write_text("kept")
    with pytest.raises(OSError):
        write_atomic(target, "step00000002")
    assert (target / "inside").read_text() == "kept"
    assert os.listdir(tmp_path) == ["pointer"]
