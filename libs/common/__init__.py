"""Tandem's shared library: config, logging, bus, messages, transfer, KV hashing, engine."""

__version__ = "0.1.0"
