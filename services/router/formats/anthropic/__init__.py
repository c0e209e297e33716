"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): request bodies
-> the chat `ApiRequest` (request.py), the message object, its stream events and errors in
Anthropic's shapes (shapes.py). The handler is services/router/requests/messages.py."""
