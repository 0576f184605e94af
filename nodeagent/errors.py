"""The project's one error hierarchy.

::

    NodeAgentError
    ├── ConfigError            bad configuration or command-line input
    ├── InvalidRequest         a request (slot, plan, API body) that cannot be accepted as given
    ├── DiscoveryError         the host's hardware or kernel state (sysfs, procfs) could not be read
    ├── PlacementError         a request does not fit the free resources
    ├── NotFound               a named slot, device or file does not exist
    ├── Conflict               the request clashes with existing state
    ├── KernelError            a kernel interface refused an operation
    │   ├── CgroupError
    │   ├── DeviceAccessError
    │   └── NetworkError
    ├── Unsupported            the host lacks a feature the request needs
    ├── InsufficientStorage    the state directory's filesystem is full
    └── WorkerError            launching or supervising a worker failed

Every message says what was asked, what was found and, where there is one, what to do.
OS and library errors are translated where they enter the project (``raise ... from``).
"""

from __future__ import annotations

import errno


class NodeAgentError(Exception):
    """Base of every error nodeagent raises on purpose."""

    #: Short machine-readable code, used by the REST API's error body.
    code = "internal"


class ConfigError(NodeAgentError):
    code = "invalid_config"


class InvalidRequest(NodeAgentError):
    code = "invalid_request"


class DiscoveryError(NodeAgentError):
    code = "discovery_failed"

    def __init__(self, message: str, *, errno_: int | None = None) -> None:
        super().__init__(message)
        #: What the kernel said, when a read failed (a caller may take EOPNOTSUPP as "none here").
        self.errno = errno_


class PlacementError(NodeAgentError):
    code = "does_not_fit"


class NotFound(NodeAgentError):
    code = "not_found"


class Conflict(NodeAgentError):
    code = "conflict"


class Unsupported(NodeAgentError):
    code = "unsupported"


class KernelError(NodeAgentError):
    """A kernel interface (a file under /sys, a syscall) refused what we asked."""

    code = "kernel_error"

    def __init__(self, message: str, *, errno_: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno_


class CgroupError(KernelError):
    code = "cgroup_error"


class DeviceAccessError(KernelError):
    code = "device_access_error"


class NetworkError(KernelError):
    code = "network_error"


class WorkerError(NodeAgentError):
    code = "worker_error"


class InsufficientStorage(NodeAgentError):
    """The filesystem of the state directory is full (or nearly): nothing was changed."""

    code = "insufficient_storage"


#: What a full filesystem looks like to a write: no space, or the user's quota used up.
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


_HINTS = {
    errno.EACCES: "run as root or on a delegated subtree",
    errno.EPERM: "run as root or on a delegated subtree",
    errno.ENOENT: "check that the path exists and the kernel feature is enabled",
    errno.EBUSY: "the object is in use; stop what uses it first",
    errno.EINVAL: "the kernel rejected the value; check it against the interface's documentation",
    errno.ENOSPC: "a kernel limit was reached",
}


def os_error_message(action: str, err: OSError) -> str:
    """Describe an OSError for a user: what we tried, what the kernel said, what to do."""
    reason = err.strerror or str(err)
    hint = _HINTS.get(err.errno or 0)
    msg = f"{action}: {reason}"
    if err.errno is not None:
        msg += f" ({errno.errorcode.get(err.errno, err.errno)})"
    if hint:
        msg += f"; {hint}"
    return msg


def translate_os_error(action: str, err: OSError, cls: type[KernelError] = KernelError) -> KernelError:
    """Build the project's error for an OSError raised while doing ``action``."""
    return cls(os_error_message(action, err), errno_=err.errno)
