"""Speculative decoding: the config (``config.py``), draft proposers (``proposers.py``) and
the verification of drafts against the target's scores (``verify.py``). The engine drives
them; nothing here knows about the scheduler's queues or the server."""
