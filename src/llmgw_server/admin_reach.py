"""Reaching the leader's admin API among control planes that share a store.

The CLI is given one control plane (`--control URL`) or several (comma-separated). A
standby answers 307 naming the leader: the request goes there, with its token, only
when the leader is one of the control planes given (a standby is not trusted to send
the admin token anywhere else). One that cannot be reached, or that knows no leader
(503), passes the request to the next one given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx


def origin(url: str) -> str:
    """scheme://host:port of `url` (the port written out), lowercase."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme.lower()}://{host}:{port}"


def controls(text: str) -> list[str]:
    """The control planes of a `--control` value: one URL, or several, comma-separated."""
    return [url.strip().rstrip("/") for url in text.split(",") if url.strip()]


class LeaderClient:
    """`get` and `post` on any of `urls`' admin API, answered by the leader."""

    def __init__(self, urls: Sequence[str], client: httpx.Client) -> None:
        self.urls = list(urls)
        self._origins = [origin(url) for url in self.urls]
        self._client = client
        self._at = 0  # the last one that answered

    def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, **kwargs)

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """`url` is on the first control plane given; the path is asked of the leader.
        Raises httpx.HTTPError when none could be reached."""
        parts = urlsplit(url)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        count = len(self._origins)
        at, tried, hops = self._at, 0, 0
        failed: httpx.TransportError | None = None
        response: httpx.Response | None = None
        while tried < count:
            base = self.urls[at]
            try:
                response = self._client.request(method, origin(base) + path, **kwargs)
            except httpx.TransportError as exc:
                failed = exc
                at, tried = (at + 1) % count, tried + 1
                continue
            if response.status_code == 307 and hops < count:
                leader = origin(response.headers.get("location", ""))
                if leader in self._origins:
                    at, hops = self._origins.index(leader), hops + 1
                    continue
            if response.status_code == 503 and _no_leader(response) and tried + 1 < count:
                at, tried = (at + 1) % count, tried + 1
                continue
            self._at = at
            return response
        if response is not None:
            return response
        assert failed is not None
        raise failed


def _no_leader(response: httpx.Response) -> bool:
    try:
        error = response.json().get("error", {})
    except ValueError:
        return False
    return isinstance(error, dict) and error.get("code") == "no_leader"
