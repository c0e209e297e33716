"""Benchmarks: `python -m bench.<name> --json`."""
