"""Research benchmarks run from a clone (not in the wheel): python -m benchmarks.research --help."""
