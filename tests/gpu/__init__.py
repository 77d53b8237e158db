"""GPU checks (a package, so that its test_memory.py, test_offload.py ... do not clash with tests/)."""
