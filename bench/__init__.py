"""Benchmarks and load generation (``python -m bench``): a tool run from the repository root,
not part of the served ``app`` package or its image."""
