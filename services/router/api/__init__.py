"""The HTTP surface: routes and middleware (app.py), the completions and chat handlers
from requests/, /openapi.json (openapi.py), /v1/pins (pins.py), /v1/chat/render
(render.py). The top room: it may import every other room; none imports it."""
