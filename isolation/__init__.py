"""Turning a slot's assignment into kernel state: cpusets, devices, network, resctrl, QoS."""
