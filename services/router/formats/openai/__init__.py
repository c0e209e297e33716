"""OpenAI's shapes: the accepted request fields -> ApiRequest (validation.py), and the
response bodies and stream chunks (shapes.py). May import structured/ and errors.py; no
aiohttp, no bus."""
