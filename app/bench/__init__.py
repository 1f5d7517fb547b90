"""Benchmarks and load generation (``python -m app.bench``)."""
