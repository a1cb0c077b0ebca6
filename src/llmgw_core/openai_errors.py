"""Errors in the shapes clients parse: OpenAI's {"error": {"message", "type", "code"}},
and on Anthropic's Messages API its own {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

import json
from collections.abc import Callable

import attrs

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    411: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}

_CODES = {
    400: "bad_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    411: "length_required",
    413: "request_too_large",
    431: "headers_too_large",
    500: "internal_error",
    502: "bad_gateway",
    503: "no_healthy_replica",
    504: "upstream_timeout",
}


def error_body(status: int, message: str, code: str | None = None) -> bytes:
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": _TYPES.get(
                    status, "server_error" if status >= 500 else "invalid_request_error"
                ),
                "code": code or _CODES.get(status, str(status)),
            }
        }
    ).encode()


def sse_error_event(status: int, message: str) -> bytes:
    """The event that ends a stream which broke after its first byte."""
    return b"data: " + error_body(status, message) + b"\n\n"


# Anthropic's error types by status (its API's "Errors" page); 503 is its overloaded.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str, code: str | None = None) -> bytes:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


def anthropic_sse_error_event(status: int, message: str) -> bytes:
    """The event that ends a Messages stream which broke after its first byte."""
    return b"event: error\ndata: " + anthropic_error_body(status, message) + b"\n\n"


@attrs.frozen
class ErrorShape:
    """How errors made by llmgw are written on a path: a whole answer's body, and the
    event that ends a broken stream."""

    body: Callable[[int, str, str | None], bytes]
    event: Callable[[int, str], bytes]


OPENAI = ErrorShape(error_body, sse_error_event)
ANTHROPIC = ErrorShape(anthropic_error_body, anthropic_sse_error_event)
