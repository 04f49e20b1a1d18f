"""The background writer's O_DIRECT path (megapost.checkpoint.stream_write, ``direct=True``): the same
bytes as the buffered path, read back by safetensors, the file cut to its true size, the page cache
bypassed where the filesystem allows, a buffered fallback where it does not, and no half file left under
the final name when the write fails midway."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch
from safetensors import safe_open

from megapost.checkpoint import stream_write
from megapost.checkpoint.stream_write import BLOCK, Staging, write_safetensors

ENTRIES = [("g", torch.randn(3001)), ("a", torch.randn(3, 5)), ("b", torch.arange(7)),
           ("c", torch.randn(4).bfloat16()), ("d", torch.tensor(3.0)), ("e", torch.zeros(0)),
           ("f", torch.randn(6, 4)[:, :2]), ("h", torch.ones(3, dtype=torch.bool))]  # "g": 12,004 bytes


def _opened_flags(monkeypatch) -> list[int]:
    flags: list[int] = []
    real = os.open

    def spy(path, mode, *a, **kw):
        flags.append(mode)
        return real(path, mode, *a, **kw)

    monkeypatch.setattr(stream_write.os, "open", spy)
    return flags


@pytest.mark.parametrize("blocks", [1, 2, 5])  # a staging buffer smaller than, and larger than, "g"
def test_direct_write_is_byte_identical_to_the_buffered_one(tmp_path, monkeypatch, blocks) -> None:
    if not stream_write.direct_supported(str(tmp_path), {}):
        pytest.skip("this filesystem refuses O_DIRECT (the fallback test covers it)")
    flags = _opened_flags(monkeypatch)
    direct, buffered = tmp_path / "direct.safetensors", tmp_path / "buffered.safetensors"
    write_safetensors(str(direct), ENTRIES, {"megapost": "{}"}, Staging(blocks * BLOCK), direct=True,
                      pause=lambda: None)  # drains after "g", mid-block: the staged tail must be kept
    assert any(f & os.O_DIRECT for f in flags), "the direct write did not open with O_DIRECT"
    write_safetensors(str(buffered), ENTRIES, {"megapost": "{}"}, Staging(blocks * BLOCK))
    assert direct.read_bytes() == buffered.read_bytes()
    data = sum(t.numel() * t.element_size() for _, t in ENTRIES)
    header = int.from_bytes(direct.read_bytes()[:8], "little")
    assert direct.stat().st_size == 8 + header + data  # the zero-padded last block cut off
    with safe_open(str(direct), framework="pt") as f:
        for name, t in ENTRIES:
            assert torch.equal(f.get_tensor(name), t), name


def test_a_filesystem_without_o_direct_gets_buffered_writes(tmp_path, monkeypatch) -> None:
    staging = Staging(BLOCK)
    staging.direct[os.stat(tmp_path).st_dev] = False  # what a probe of such a filesystem leaves
    flags = _opened_flags(monkeypatch)
    path = tmp_path / "x.safetensors"
    write_safetensors(str(path), ENTRIES, {}, staging, direct=True)
    assert not any(f & getattr(os, "O_DIRECT", 0) for f in flags)
    with safe_open(str(path), framework="pt") as f:
        assert torch.equal(f.get_tensor("g"), ENTRIES[0][1])


def test_a_direct_write_failing_midway_leaves_no_file(tmp_path) -> None:
    path = tmp_path / "x.safetensors"

    def full_disk() -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError, match=str(path)):
        write_safetensors(str(path), ENTRIES, {}, Staging(BLOCK), direct=True, pause=full_disk)
    assert os.listdir(tmp_path) == []


def _fs_type_by_stat(directory: str) -> str:
    out = subprocess.run(["stat", "-f", "-c", "%T", directory], capture_output=True, text=True)
    return out.stdout.strip()


def test_a_memory_filesystem_gets_buffered_writes(monkeypatch) -> None:
    directory = "/dev/shm"
    if not os.path.isdir(directory) or _fs_type_by_stat(directory) != "tmpfs":
        pytest.skip(f"{directory} is not tmpfs here (coreutils stat)")
    assert stream_write.filesystem_type(directory) == "tmpfs"
    flags = _opened_flags(monkeypatch)
    assert not stream_write.direct_supported(directory, {})
    assert not any(f & getattr(os, "O_DIRECT", 0) for f in flags), "tmpfs was probed with O_DIRECT"


@pytest.mark.parametrize("where", ["tmp", "cwd", "root", "shm"])
def test_the_memory_filesystem_verdict_agrees_with_coreutils_stat(tmp_path, where) -> None:
    directory = {"tmp": str(tmp_path), "cwd": os.getcwd(), "root": "/", "shm": "/dev/shm"}[where]
    by_stat = _fs_type_by_stat(directory) in {"tmpfs", "ramfs"}
    assert (stream_write.filesystem_type(directory) in stream_write.MEMORY_FS) == by_stat
