"""Developer scripts (`make run` is `python -m scripts.cluster`)."""
