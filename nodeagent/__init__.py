"""nodeagent: a per-host agent that carves a server's CPUs, NUMA nodes and accelerators into
isolated slots for ML inference workers.

The top-level folders of the repository install as subpackages of this namespace:
``nodeagent.devices`` (discovery), ``nodeagent.cgroups``, ``nodeagent.isolation``,
``nodeagent.runtime``, ``nodeagent.placement`` (pure placement decisions) and ``nodeagent.agent``
(the daemon and the CLI).
"""

from nodeagent.errors import NodeAgentError

__version__ = "0.1.0"

__all__ = ["NodeAgentError", "__version__"]
