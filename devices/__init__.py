"""Read-only discovery of the host's hardware: CPUs, NUMA nodes, GPUs, FPGAs, PCI devices."""
