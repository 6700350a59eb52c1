"""The OpenAI-compatible HTTP server (``blitz serve``): app.py (options, uvicorn runner),
api.py (FastAPI routes, auth, lifecycle), protocol.py (request models), serving.py + chat.py
+ completions.py (endpoint logic), errors.py (OpenAI error bodies), metrics.py (Prometheus)."""
