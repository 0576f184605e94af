"""nodeagent.atomicfile: the one atomic replace of a file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from nodeagent.atomicfile import is_temporary, write_atomic


def test_writes_text_and_bytes(tmp_path: Path) -> None:
    path = tmp_path / "record.json"
    write_atomic(path, "one\n")
    assert path.read_text() == "one\n"
    write_atomic(str(path), b"two", durable=True)
    assert path.read_bytes() == b"two"
    assert os.listdir(tmp_path) == ["record.json"]  # no temporary left


@pytest.mark.parametrize("mode", [0o600, 0o644, 0o640])
def test_mode_is_exact_whatever_the_umask(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "f"
    old = os.umask(0o077)
    try:
        write_atomic(path, "x", mode=mode)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    write_atomic(path, "y", mode=0o600)  # a rewrite takes the new mode too
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_failure_keeps_the_old_file_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.json"
    path.write_text("old")

    def refuse(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="No space"):
        write_atomic(path, "new", durable=True)
    monkeypatch.undo()
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["state.json"]


def test_failure_to_create_the_temporary_is_the_callers(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "missing" / "f", "x")


def test_temporary_names() -> None:
    assert is_temporary(".nodeagent-slot-s1.json.123.456.tmp")
    assert is_temporary(".s1.json.tmp")  # an older agent's
    assert not is_temporary("s1.json")
    assert not is_temporary("holder-x.tmp")
