"""Admission: whether a request may start now, checked before any costly work (gate.py:
the bound on requests in flight, a live decode worker). A per-tenant queue goes here.
Imports only the shared modules (errors.py, state.py)."""
