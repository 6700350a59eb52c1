"""The OpenAI-compatible HTTP server (``blitz serve``): app.py (options, uvicorn runner), config.py
(its settings), api.py (FastAPI routes, auth, lifecycle), protocol.py (request models), openapi.py
(the /openapi.json schema), serving.py + chat.py + completions.py (endpoint logic), responses.py +
responses_items.py + responses_protocol.py + responses_store.py (the Responses API), chat_template.py
(messages through the model's template), tools.py and reasoning.py (tool-call and reasoning parsers),
kv_routes.py (KV-transfer control plane), errors.py (OpenAI error bodies), metrics.py (Prometheus)."""
