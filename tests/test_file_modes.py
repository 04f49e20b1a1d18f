"""Files megapost writes get the mode ``open`` would give them (0644 under the usual umask 022), also
where the writer of the temp made it private (``mkstemp``, safetensors' ``save_file``: 0600)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from megapost.utils.atomic import atomic_path, current_umask


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask():
    """Set the umask for one test, restore it after."""
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_file_gets_the_umask_mode(tmp_path, umask, mask, expected) -> None:
    umask(mask)
    assert current_umask() == mask
    target = tmp_path / "f.bin"
    with atomic_path(target) as tmp:
        fd, private = tempfile.mkstemp(dir=tmp_path)  # 0600, as mkstemp makes every file
        os.close(fd)
        os.replace(private, tmp)
    assert _mode(target) == expected


def test_hf_export_files_are_0644(tiny_data, tmp_path, umask) -> None:
    from megapost.checkpoint.hf import export
    from megapost.model import LlamaModel, ModelConfig

    umask(0o022)
    cfg = ModelConfig(vocab_size=512, num_layers=1, hidden_size=32, ffn_hidden_size=64,
                      num_attention_heads=2, seq_length=16, norm_position="post")
    out = tmp_path / "hf"
    export(LlamaModel(cfg).state_dict(), cfg, tiny_data.tokenizer_model, str(out))
    modes = {p.name: oct(_mode(p)) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes
