"""Tools run from the command line: the benchmark (python -m qvl.bench) and the stress test (python -m qvl.stress)."""
