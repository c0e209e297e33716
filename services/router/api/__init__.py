"""The HTTP surface: routes and middleware (app.py), request bodies, SSE, /openapi.json,
/v1/pins, /v1/chat/render; one folder per API format (openai/; responses/ and anthropic/
go beside it). May import requests/, routing/, structured/ and the shared modules."""
