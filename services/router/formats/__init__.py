"""Request and response formats: a JSON body and the model name checked first (bodies.py),
Server-Sent Events framing (sse.py), and one folder per API format: openai/ (the accepted
fields -> ApiRequest, and the response shapes); responses/ and anthropic/ go beside it.
May import structured/, state.py and the shared modules; never requests/ or api/."""
