"""Tandem services, each started with `python -m services.<name>`."""
