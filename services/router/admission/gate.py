"""Step 2 of a request (services/router/requests/lifecycle.py): may it start now?

Checked after parsing and before tokenizing, so a refused request costs no CPU: 429 when
the router is at `--max-pending` requests in flight, 503 when no decode worker is live.
"""

from __future__ import annotations

from services.router.errors import ApiError, no_workers
from services.router.state import RouterState


def admit(state: RouterState) -> None:
    """Refuse when the router is at its bound (429) or no decode worker is live (503)."""
    if state.pending >= state.config.max_pending:
        raise ApiError(
            429,
            f"the router is at its bound of {state.config.max_pending} requests in flight",
            code="too_many_requests",
            headers={"Retry-After": "1"},
        )
    if not state.selector.eligible("decode"):
        raise no_workers("no decode worker is live; retry shortly")
