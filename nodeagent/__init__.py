"""nodeagent: a per-host agent that carves a server's CPUs, NUMA nodes and accelerators into
isolated slots for ML inference workers.

The top-level folders of the repository install as subpackages of this namespace:
``nodeagent.schema`` (the request and worker spec), ``nodeagent.devices`` (discovery),
``nodeagent.placement`` (pure placement decisions), ``nodeagent.cgroups``, ``nodeagent.isolation``,
``nodeagent.runtime``, ``nodeagent.agent`` (the daemon) and ``nodeagent.cli`` (the operator's
command; each subcommand loads only what it uses). docs/architecture.md draws the house.
"""

from nodeagent.errors import NodeAgentError

__version__ = "0.1.0"

__all__ = ["NodeAgentError", "__version__"]
