"""The OpenAI-compatible HTTP server (``blitz serve``): app.py (routes, lifecycle),
protocol.py (request models), serving.py + chat.py + completions.py (endpoint logic),
errors.py (OpenAI error bodies), metrics.py (Prometheus)."""
