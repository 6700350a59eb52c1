"""Assertions shared by the server tests."""
from __future__ import annotations

import httpx


def check_error(r: httpx.Response, status: int, param) -> dict:
    """An OpenAI-style error body with the given status (and param, when not None)."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err
