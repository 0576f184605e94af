"""The sysfs and procfs readers on fake trees written into tmp_path: absent is None, other OS errors
and unparsable content are DiscoveryErrors naming the file, and the root is wherever it is put."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from nodeagent import kernelfs
from nodeagent.errors import DiscoveryError
from nodeagent.kernelfs import KernelFs, Procfs, Sysfs
from tests.trees import Link, write_tree

TREE = {
    "devices/system/cpu/online": "0-3,8\n",
    "devices/system/cpu/isolated": "\n",
    "devices/system/node/node1/numa_node": "-1\n",
    "devices/system/node/node0/numa_node": "  0 \n",
    "devices/pci0000:00/0000:00:01.0/drm/card0/dev": "226:0\n",
    "devices/pci0000:00/0000:00:01.0/drm/card0/subsystem": Link("../../../../../class/drm"),
    "devices/pci0000:00/0000:00:01.0/vendor": "0x10de\n",
    "devices/pci0000:00/0000:00:01.0/driver": Link("../../../bus/pci/drivers/nvidia"),
    "class/drm/": "",
    "bus/pci/drivers/nvidia/": "",
    "bus/pci/devices/0000:00:01.0": Link("../../../devices/pci0000:00/0000:00:01.0"),
    "garbage/int": "twelve\n",
    "garbage/cpulist": "3-1\n",
    "self/status": "Name:\tnodeagent\nState:\tR (running)\n",
}

READERS = [pytest.param(Sysfs, id="sysfs"), pytest.param(Procfs, id="procfs")]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return write_tree(tmp_path / "tree", TREE)


def test_default_roots_are_the_kernels() -> None:
    assert (Sysfs().root, Procfs().root) == (Path("/sys"), Path("/proc"))
    assert repr(Sysfs(Path("/captured/sys"))) == "Sysfs('/captured/sys')"


def test_the_real_procfs_reads_like_a_fake_one() -> None:
    status = Procfs().read_text("self/status")
    assert status is not None
    assert status.startswith("Name:")


@pytest.mark.parametrize("reader", READERS)
def test_absent_is_none_whatever_is_asked(root: Path, reader: type[KernelFs]) -> None:
    fs = reader(root)
    for rel in ("absent", "devices/absent/deeper"):
        found = (fs.read_bytes(rel), fs.read_text(rel), fs.read_int(rel), fs.read_cpulist(rel))
        assert found == (None, None, None, None)
        assert (fs.listdir(rel), fs.subdirs(rel), fs.link_name(rel)) == (None, None, None)
        assert (fs.exists(rel), fs.is_dir(rel), fs.is_file(rel)) == (False, False, False)


def test_contents_as_asked(root: Path) -> None:
    sysfs = Sysfs(root)
    assert sysfs.read_bytes("devices/system/cpu/online") == b"0-3,8\n"
    assert sysfs.read_text("devices/system/node/node0/numa_node") == "0"
    assert sysfs.read_int("devices/system/node/node0/numa_node") == 0
    assert sysfs.read_int("devices/system/node/node1/numa_node") == -1
    assert sysfs.read_cpulist("devices/system/cpu/online") == frozenset({0, 1, 2, 3, 8})
    assert sysfs.read_cpulist("devices/system/cpu/isolated") == frozenset()
    assert sysfs.read_text("devices/system/cpu/isolated") == ""
    assert sysfs.path("devices/system/cpu/online") == f"{root}/devices/system/cpu/online"


def test_directories_links_and_real_paths(root: Path) -> None:
    sysfs = Sysfs(root)
    function = "bus/pci/devices/0000:00:01.0"
    assert sysfs.listdir("devices/system/node") == ["node0", "node1"]
    assert sysfs.listdir(function) == ["driver", "drm", "vendor"]
    assert sysfs.subdirs(f"{function}/drm/card0") == []  # `subsystem` is a link: not walked into
    assert sysfs.subdirs(function) == ["drm"]  # through the link to the function itself
    assert sysfs.link_name(f"{function}/driver") == "nvidia"
    assert sysfs.real_path(function) == str(root / "devices/pci0000:00/0000:00:01.0")
    assert (sysfs.is_file(f"{function}/drm/card0/dev"), sysfs.is_dir(f"{function}/drm")) == (True, True)


@pytest.mark.parametrize(
    ("read", "rel", "message"),
    [
        pytest.param("read_int", "garbage/int", "expected an integer, found 'twelve\\n'", id="int"),
        pytest.param("read_cpulist", "garbage/cpulist", "expected a cpulist such as '0-3,8'", id="cpulist"),
        pytest.param("read_text", "devices", "Is a directory (EISDIR)", id="directory-as-file"),
        pytest.param("listdir", "garbage/int", "expected a directory, found a file", id="file-as-directory"),
        pytest.param("subdirs", "garbage/int", "Not a directory (ENOTDIR)", id="file-walked-into"),
        pytest.param("link_name", "garbage/int", "reading link", id="file-as-link"),
    ],
)
@pytest.mark.parametrize("reader", READERS)
def test_what_cannot_be_read_names_the_file(
    root: Path, reader: type[KernelFs], read: str, rel: str, message: str
) -> None:
    with pytest.raises(DiscoveryError) as raised:
        getattr(reader(root), read)(rel)
    assert f"{root}/{rel}" in str(raised.value)
    assert message in str(raised.value)


@pytest.mark.parametrize(("reader", "kind"), [(Sysfs, "sysfs"), (Procfs, "procfs")], ids=["sysfs", "procfs"])
def test_garbage_says_which_tree_is_damaged(root: Path, reader: type[KernelFs], kind: str) -> None:
    (root / "binary").write_bytes(b"\xff\xfe")
    with pytest.raises(DiscoveryError, match=f"expected text, .*the {kind} tree is damaged"):
        reader(root).read_text("binary")


def test_procfs_reads_a_fake_proc(root: Path) -> None:
    procfs = Procfs(root)
    assert procfs.read_text("self/status") == "Name:\tnodeagent\nState:\tR (running)"
    assert procfs.exists("self/status")


def test_a_process_that_ends_mid_read_is_absent_in_procfs_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def gone(*_args: object, **_kwargs: object) -> None:
        raise ProcessLookupError(errno.ESRCH, "No such process")

    monkeypatch.setattr(kernelfs, "read_all", gone)
    assert Procfs(tmp_path).read_text("42/stat") is None
    with pytest.raises(DiscoveryError) as info:
        Sysfs(tmp_path).read_text("devices/system/cpu/online")
    assert info.value.errno == errno.ESRCH


def test_a_refused_read_keeps_the_kernels_errno(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(kernelfs, "read_all", refused)
    with pytest.raises(DiscoveryError, match="pressure/cpu") as info:
        Procfs(tmp_path).read_text("pressure/cpu")
    assert info.value.errno == errno.EOPNOTSUPP
