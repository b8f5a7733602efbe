"""write_version on a full disk (services.weightstore): a small real tmpfs as the run directory.

A version that does not fit is refused with the free space and the size it needs, nothing of it
stays on disk, and the versions already written keep their bytes. Mounting needs root.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from services import weightstore as ws

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")

FULL = r"run directory .* is full: \d+ bytes free, the version needs about \d+"


def mount_tmpfs(path: Path, options: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """Mount tmpfs at ``tmp_path/disk`` with the given options; unmounted at teardown."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        path = tmp_path / f"disk{len(mounted)}"
        mount_tmpfs(path, options)
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        unmount(path)


def weights(n_floats: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(n_floats // 8, 8, generator=g)}


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_a_version_that_does_not_fit_is_refused_before_writing_and_the_previous_stays(small_disk):
    root = small_disk("size=1m") / "weights"
    first = ws.write_version(root, 1, weights(64 << 10))  # 256 KiB
    before = ws.free_bytes(root)
    assert before is not None and before < 1 << 20

    with pytest.raises(ws.RunDirectoryFull, match=FULL) as caught:
        ws.write_version(root, 2, weights(256 << 10, seed=1))  # 1 MiB: cannot fit
    e = caught.value
    assert e.__cause__ is None, "refused by the free-space check, not by a failed write"
    assert (e.root, e.free) == (root, before)
    assert e.needed > 1 << 20
    assert str(e) == f"run directory {root} is full: {before} bytes free, the version needs about {e.needed}"
    assert entries(root) == ["v00000001"]  # no temp directory, no half version
    assert ws.free_bytes(root) == before
    ws.verify(first.path, first.sha256)
    assert ws.read_record(first.path).sha256 == first.sha256


def test_running_out_of_space_while_writing_leaves_nothing(small_disk, tmp_path):
    # the bytes fit, the inodes do not: the check passes and the file creation hits ENOSPC
    # (the way a write races another writer for the last of a disk)
    root = small_disk("size=4m,nr_inodes=6")  # the mount's root, v1's directory and files, v2's temp directory
    first = ws.write_version(root, 1, weights(1024))
    assert ws.free_bytes(root) > ws.version_bytes(weights(1024))

    with pytest.raises(ws.RunDirectoryFull, match=FULL) as caught:
        ws.write_version(root, 2, weights(1024, seed=1))
    assert "No space left on device" in str(caught.value.__cause__)
    assert entries(root) == ["v00000001"]
    ws.verify(first.path, first.sha256)

    # once there is room again, the same version writes normally
    ws.delete_version(root, 1)
    written = ws.write_version(root, 2, weights(1024, seed=1))
    ws.verify(written.path, written.sha256)


def test_running_out_of_space_inside_the_weights_file(small_disk, monkeypatch):
    # a filesystem that reports no capacity (some FUSE mounts) is not checked first: the
    # writer's own ENOSPC (a SafetensorError from the Rust writer) gives the same error
    root = small_disk("size=512k")
    first = ws.write_version(root, 1, weights(16 << 10))  # 64 KiB
    filler = root / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * (ws.free_bytes(root) - (96 << 10)))  # leave 96 KiB: the check alone would pass v2 at 64 KiB
    tensors = weights(32 << 10, seed=1)  # 128 KiB: more than is left
    monkeypatch.setattr(ws, "free_bytes", lambda path: None)  # what such a mount reports
    with pytest.raises(ws.RunDirectoryFull, match=FULL) as caught:
        ws.write_version(root, 2, tensors)
    monkeypatch.undo()
    assert "os error 28" in str(caught.value.__cause__)
    assert entries(root) == ["filler", "v00000001"]
    ws.verify(first.path, first.sha256)
