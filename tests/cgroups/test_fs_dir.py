"""Reading a cgroup's files through a directory checked once (fs.CgroupDir), as a scrape does."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from nodeagent.cgroups import fs
from nodeagent.errors import CgroupError


def tree(root: Path, files: dict[str, str]) -> Path:
    for relpath, content in files.items():
        path = root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return root


@pytest.fixture
def slot(tmp_path: Path) -> fs.CgroupDir:
    root = tree(
        tmp_path / "cg",
        {
            "nodeagent.slice/s1/cpu.stat": "usage_usec 7\nnr_periods 3\n",
            "nodeagent.slice/s1/memory.current": "4096\n",
        },
    )
    return fs.resolve_dir(root, "nodeagent.slice/s1")


def test_files_are_read_by_name_with_the_same_parsers(slot: fs.CgroupDir) -> None:
    assert fs.read_file(slot, "memory.current") == "4096\n"
    assert fs.read_int(slot, "memory.current") == 4096
    assert fs.read_keyed(slot, "cpu.stat") == {"usage_usec": 7, "nr_periods": 3}


def test_a_missing_file_is_none_when_optional_and_an_error_with_errno_otherwise(slot: fs.CgroupDir) -> None:
    assert fs.read_optional(slot, "memory.peak") is None
    with pytest.raises(CgroupError) as caught:
        fs.read_file(slot, "memory.peak")
    assert caught.value.errno == errno.ENOENT


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("../s2/memory.current", id="dotdot"),
        pytest.param("child/memory.current", id="subpath"),
        pytest.param("..", id="parent"),
        pytest.param("", id="empty"),
    ],
)
def test_only_a_file_directly_in_the_directory_is_read(slot: fs.CgroupDir, name: str) -> None:
    with pytest.raises(CgroupError, match="name a file directly in the directory") as caught:
        fs.read_file(slot, name)
    assert caught.value.errno == errno.EINVAL


def test_a_symlink_in_a_files_place_is_refused(tmp_path: Path, slot: fs.CgroupDir) -> None:
    secret = tmp_path / "secret"
    secret.write_text("42\n")
    (slot.path / "pids.current").symlink_to(secret)
    with pytest.raises(CgroupError) as caught:
        fs.read_optional(slot, "pids.current")
    assert caught.value.errno == errno.ELOOP


def test_the_directory_itself_is_checked_once_against_symlink_escapes(tmp_path: Path) -> None:
    root = tree(tmp_path / "cg", {"nodeagent.slice/cpu.stat": ""})
    outside = tree(tmp_path / "outside", {"memory.current": "1\n"})
    (root / "slot").symlink_to(outside)
    with pytest.raises(CgroupError, match="outside the cgroup root"):
        fs.resolve_dir(root, "slot")


def test_a_number_file_that_is_not_a_number_names_the_file(slot: fs.CgroupDir) -> None:
    (slot.path / "pids.max").write_text("lots\n")
    with pytest.raises(CgroupError, match=r"s1/pids.max, found 'lots'"):
        fs.read_int(slot, "pids.max")


def test_real_path_agrees_with_realpath_for_existing_and_missing_paths(tmp_path: Path) -> None:
    root = tree(tmp_path / "cg", {"a/b/f": ""})
    (tmp_path / "link").symlink_to(root / "a")
    for path in (tmp_path / "link" / "b" / "f", tmp_path / "link" / "missing" / "x", root):
        assert fs.real_path(path) == str(path.resolve())
