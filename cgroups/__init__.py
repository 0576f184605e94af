"""The kernel's cgroup filesystems (v1, v2, hybrid) behind one small manager interface."""
