"""nodeagent: a per-host agent that carves a server's CPUs, NUMA nodes and accelerators into
isolated slots for ML inference workers.

The top-level folders of the repository install as subpackages of this namespace:
``nodeagent.devices`` (discovery), ``nodeagent.cgroups``, ``nodeagent.isolation``,
``nodeagent.runtime``, ``nodeagent.agent`` (the daemon and placement) and ``nodeagent.cli`` (the
operator's command; each subcommand loads only what it uses).
"""

from nodeagent.errors import NodeAgentError

__version__ = "0.1.0"

__all__ = ["NodeAgentError", "__version__"]
