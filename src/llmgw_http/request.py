"""A request as the server hands it to a handler, and the server's own refusal of one."""

from __future__ import annotations

import attrs


@attrs.define(slots=True)
class Request:
    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]  # names lower-cased by h11
    body: bytes = b""
    http_version: bytes = b"1.1"
    # Set by the server's head check (HTTPServer's check_head), for the handler: the
    # digest of the client's credential (the router's: its API key), None if it sent none.
    credential: str | None = None
    head_checked: bool = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def path(self) -> bytes:
        return self.target.partition(b"?")[0]


class RequestRejected(Exception):
    """Raised by the server itself for a request it will not hand to the handler."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
