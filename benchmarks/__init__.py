"""Benchmark scripts, run from the repository root as ``python -m benchmarks.<name>``.

``common.py`` is their shared frame (flags, the environment record, JSON lines) and ``zoo/``
the model zoo they share with the tests; ``README.md`` indexes the current results.
"""
