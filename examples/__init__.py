"""Runnable examples; ``examples.models`` holds the transformer the benchmarks reuse."""
