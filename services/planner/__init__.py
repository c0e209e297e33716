"""The planner: sizes prefill and decode from queue time and SLOs (README.md)."""
