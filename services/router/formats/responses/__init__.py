"""OpenAI's Responses API (POST /v1/responses): the request's closed field table and its
translation to chat (request.py), the response object and its items (shapes.py), the typed
stream events in OpenAI's order (events.py). May import formats/openai/, structured/,
state.py and the shared modules; never requests/ or api/."""
