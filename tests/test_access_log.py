"""The access log and the request id: the pure formatting, then a real router process in
front of real engines (the mock engine, or a stub that shows what the engine received)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from llmgw_core.config import parse_config
from llmgw_core.tomlshape import ConfigError
from llmgw_server.router.access_log import (
    AccessRecord,
    format_json,
    format_logfmt,
    key_id_of,
    timestamp,
    usage_in,
    valid_request_id,
)
from procs import Proc, Procs, models_toml

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]
KEY = "sk-test-secret-key"
KEY_ID = hashlib.sha256(KEY.encode()).hexdigest()[:8]
AUTH = f'\n[auth]\napi_keys = ["sha256:{hashlib.sha256(KEY.encode()).hexdigest()}"]\n'


def parse_logfmt(line: str) -> dict[str, Any]:
    """key=value pairs; a quoted value is a JSON string."""
    fields: dict[str, Any] = {}
    i = 0
    while i < len(line):
        eq = line.index("=", i)
        key = line[i:eq]
        if line[eq + 1 : eq + 2] == '"':
            value, end = json.JSONDecoder().raw_decode(line, eq + 1)
        else:
            end = line.find(" ", eq + 1)
            end = len(line) if end < 0 else end
            value = line[eq + 1 : end]
        assert key not in fields, line
        fields[key] = value
        i = end + 1
    return fields


def access_lines(router: Proc, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The router's access log lines (logfmt, on its stderr), once there are `count`."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [
            parse_logfmt(line) for line in router.output().splitlines() if line.startswith("time=")
        ]
        if len(lines) >= count or time.monotonic() > deadline:
            assert len(lines) == count, (lines, router.output())
            return lines
        time.sleep(0.05)


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=20)


# --------------------------------------------------------------------------- pure


def record(**changes: Any) -> AccessRecord:
    base = AccessRecord(
        started=1_796_243_533.0425,
        request_id="abc-1",
        method="POST",
        path="/v1/chat/completions",
        key_id="f77894fd",
        model="m",
        replica="http://10.0.0.5:8000",
        status=200,
        duration_s=0.0123456,
        ttfb_s=0.0021,
        bytes_sent=399,
        prompt_tokens=7,
        completion_tokens=16,
    )
    for name, value in changes.items():
        setattr(base, name, value)
    return base


def test_logfmt_line_has_every_field_in_order() -> None:
    line = format_logfmt(record())
    assert line == (
        "time=2026-12-02T20:32:13.042Z request_id=abc-1 method=POST path=/v1/chat/completions "
        "model=m status=200 replica=http://10.0.0.5:8000 duration_ms=12.346 ttfb_ms=2.100 "
        "bytes=399 key_id=f77894fd tenant=- prompt_tokens=7 completion_tokens=16 queued_ms=- "
        "cached_predicted=- migrated=0\n"
    )


def test_logfmt_marks_unknowns_and_quotes_client_text() -> None:
    line = format_logfmt(
        record(
            model='a "b"=c\nd',
            replica=None,
            ttfb_s=None,
            key_id=None,
            prompt_tokens=None,
            completion_tokens=None,
            status=0,
        )
    )
    assert line.endswith("\n") and "\n" not in line[:-1]
    fields = parse_logfmt(line[:-1])
    assert fields["model"] == 'a "b"=c\nd'
    assert fields["replica"] == fields["ttfb_ms"] == fields["key_id"] == "-"
    assert fields["prompt_tokens"] == fields["completion_tokens"] == "-"
    assert fields["status"] == "0"
    long = parse_logfmt(format_logfmt(record(model="x" * 5000, path="/" + "p" * 5000))[:-1])
    assert long["model"] == "x" * 256 + "..." and long["path"] == "/" + "p" * 255 + "..."


def test_json_line_matches_the_logfmt_fields() -> None:
    r = record(ttfb_s=None, model="é\u2028")
    data = json.loads(format_json(r))
    assert data == {
        "time": "2026-12-02T20:32:13.042Z",
        "request_id": "abc-1",
        "method": "POST",
        "path": "/v1/chat/completions",
        "model": "é\u2028",
        "status": 200,
        "replica": "http://10.0.0.5:8000",
        "duration_ms": 12.346,
        "ttfb_ms": None,
        "bytes": 399,
        "key_id": "f77894fd",
        "tenant": None,
        "prompt_tokens": 7,
        "completion_tokens": 16,
        "queued_ms": None,
        "cached_predicted": None,
        "migrated": 0,
    }
    assert format_json(r).count("\n") == 1


def test_timestamp_is_utc_with_milliseconds() -> None:
    assert timestamp(0.0) == "1970-01-01T00:00:00.000Z"
    assert timestamp(86_400.9999) == "1970-01-02T00:00:00.999Z"
    assert timestamp(86_401.5) == "1970-01-02T00:00:01.500Z"


def test_request_ids_from_clients_are_checked() -> None:
    assert valid_request_id(b"req-1:abc/DEF_2") == "req-1:abc/DEF_2"
    assert valid_request_id(b"x" * 128) == "x" * 128
    for bad in (None, b"", b"x" * 129, b"has space", b"tab\there", b"nl\n", b"\xc3\xa9"):
        assert valid_request_id(bad) is None, bad


def test_key_id_is_a_digest_prefix() -> None:
    digest = hashlib.sha256(b"sk-demo").hexdigest()
    assert key_id_of(digest) == "f77894fd" == digest[:8]


def test_usage_found_in_answers_and_streams() -> None:
    answer = json.dumps(
        {
            "choices": [{"message": {"content": 'he said "usage": {"prompt_tokens": 99}'}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
        }
    ).encode()
    assert usage_in(answer) == (7, 3)
    embeddings = b'{"data": [], "usage": {"prompt_tokens": 4, "total_tokens": 4}}'
    assert usage_in(embeddings) == (4, None)
    stream = (
        b'data: {"choices": [{"delta": {"content": "usage"}}], "usage": null}\n\n'
        b'data: {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 5}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert usage_in(stream) == (2, 5)
    # A value "usage" in content, null usage, a cut-off or nonsense usage: none.
    assert usage_in(b'{"content": "usage", "x": 1}') is None
    assert usage_in(b'data: {"usage": null}\n\n') is None
    assert usage_in(b'data: {"usage": {"prompt_tokens": 2, "complet') is None
    assert usage_in(b'{"usage": {"prompt_tokens": -1, "completion_tokens": 1}}') is None
    assert usage_in(b'{"usage": {"prompt_tokens": true}}') is None
    assert usage_in(b'{"usage": {"prompt_tokens": 1, "completion_tokens": "2"}}') is None
    assert usage_in(b'{"usage": [1, 2]}') is None
    assert usage_in(b'{"usage": {"total_tokens": 3}}') is None


def test_usage_of_the_responses_and_messages_apis() -> None:
    """Responses and Messages count input_tokens / output_tokens; a Messages stream's last
    event carries only its output (the recorder keeps the input from its first)."""
    response = b'{"object": "response", "usage": {"input_tokens": 9, "output_tokens": 4, "total_tokens": 13}}'
    assert usage_in(response) == (9, 4)
    completed = (
        b'event: response.created\ndata: {"response": {"usage": null}}\n\n'
        b'event: response.completed\ndata: {"response": {"usage": '
        b'{"input_tokens": 9, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 6}}}\n\n'
    )
    assert usage_in(completed) == (9, 6)
    start = b'event: message_start\ndata: {"message": {"usage": {"input_tokens": 12, "output_tokens": 1}}}\n\n'
    assert usage_in(start) == (12, 1)
    delta = b'event: message_delta\ndata: {"delta": {}, "usage": {"output_tokens": 15}}\n\n'
    assert usage_in(delta) == (None, 15)
    assert usage_in(start + delta) == (12, 15)  # a stream's events in one write
    assert usage_in(b'{"usage": {"input_tokens": 1, "output_tokens": -2}}') is None


def test_access_log_settings_are_checked() -> None:
    models = [{"name": "m", "endpoints": ["http://127.0.0.1:9001"]}]

    def server(**settings: Any) -> Any:
        return parse_config({"server": settings, "models": models}, "/etc/llmgw/x.toml").server

    s = server()
    assert (s.access_log, s.access_log_format, s.access_log_file) == (True, "logfmt", None)
    s = server(access_log=False, access_log_format="json")
    assert (s.access_log, s.access_log_format) == (False, "json")
    assert server(access_log_file="/tmp/a.log").access_log_file == Path("/tmp/a.log")
    with pytest.raises(ConfigError, match=r"server\.access_log_format: must be 'logfmt' or 'json'"):
        server(access_log_format="text")
    with pytest.raises(ConfigError, match=r"server\.access_log: must be true or false"):
        server(access_log="yes")
    with pytest.raises(ConfigError, match=r"server\.access_log_file: .*no directory"):
        server(access_log_file="/no/such/dir/a.log")


# --------------------------------------------------------------------------- end to end


def test_one_line_per_request_field_by_field(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "5")
    router = procs.router(models_toml({"m": [engine.url]}) + AUTH)
    api = client(router.url)

    raw = api.chat.completions.with_raw_response.create(
        model="m",
        messages=CHAT,
        extra_headers={"x-request-id": "client-id-1"},
    )
    assert raw.headers["x-request-id"] == "client-id-1"
    answer = raw.parse()
    assert answer.usage is not None
    body_size = len(raw.content)

    chunks = list(
        api.chat.completions.create(
            model="m",
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 5

    refused = httpx.post(router.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT})
    assert refused.status_code == 401
    generated = refused.headers["x-request-id"]
    assert len(generated) == 24 and int(generated, 16) >= 0

    plain, stream, unauthorized = access_lines(router, 3)
    assert set(plain) == {
        "time",
        "request_id",
        "method",
        "path",
        "model",
        "status",
        "replica",
        "duration_ms",
        "ttfb_ms",
        "bytes",
        "key_id",
        "tenant",
        "prompt_tokens",
        "completion_tokens",
        "queued_ms",
        "cached_predicted",
        "migrated",
    }
    assert plain["queued_ms"] == "-"  # never held: its model is not autoscaled
    logged_at = datetime.fromisoformat(plain["time"].replace("Z", "+00:00"))
    assert abs((datetime.now(UTC) - logged_at).total_seconds()) < 60
    assert plain["request_id"] == "client-id-1"
    assert (plain["method"], plain["path"], plain["model"]) == ("POST", "/v1/chat/completions", "m")
    assert (plain["status"], plain["replica"], plain["key_id"]) == ("200", engine.url, KEY_ID)
    assert 0 < float(plain["ttfb_ms"]) <= float(plain["duration_ms"]) < 10_000
    assert int(plain["bytes"]) == body_size
    assert plain["prompt_tokens"] == str(answer.usage.prompt_tokens)
    assert plain["completion_tokens"] == "5"

    assert len(stream["request_id"]) == 24 and stream["request_id"] != generated
    assert (stream["status"], stream["replica"], stream["key_id"]) == ("200", engine.url, KEY_ID)
    assert int(stream["bytes"]) > body_size  # the events, in chunked framing
    assert stream["prompt_tokens"] == str(usage.prompt_tokens)
    assert stream["completion_tokens"] == "5"

    assert unauthorized["request_id"] == generated
    assert (unauthorized["status"], unauthorized["replica"]) == ("401", "-")
    assert unauthorized["model"] == unauthorized["key_id"] == "-"  # the body was never read
    assert unauthorized["prompt_tokens"] == "-"
    assert KEY not in router.output()


def test_probes_are_not_logged_and_a_client_that_left_is_status_0(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "1000", "--mock-tokens-per-second", "20")
    router = procs.router(models_toml({"m": [engine.url]}))
    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(router.url + path).status_code == 200
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        json={"model": "m", "messages": CHAT, "stream": True},
        headers={"x-request-id": "goes-away", "authorization": "Bearer anything"},
    ) as response:
        lines = response.iter_lines()
        next(lines)
    assert httpx.get(router.url + "/nowhere").status_code == 404
    # The stream's line comes once the router notices the client left (at its next write,
    # or its watch on the socket within a tick): possibly after the next request's.
    logged = access_lines(router, 2)
    gone = next(line for line in logged if line["request_id"] == "goes-away")
    nowhere = next(line for line in logged if line is not gone)
    assert (gone["request_id"], gone["status"], gone["replica"]) == ("goes-away", "0", engine.url)
    assert int(gone["bytes"]) > 0 and gone["ttfb_ms"] != "-"
    # With no [auth], the key is not checked but still named by its digest, never itself.
    assert gone["key_id"] == hashlib.sha256(b"anything").hexdigest()[:8]
    assert (nowhere["path"], nowhere["status"], nowhere["model"]) == ("/nowhere", "404", "-")


class _StubEngine(BaseHTTPRequestHandler):
    """Answers like an engine that echoes the request id, and remembers what it got."""

    protocol_version = "HTTP/1.1"
    seen: list[dict[str, str]] = []

    def do_GET(self) -> None:
        self._answer(b"{}")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        self.seen.append({k.lower(): v for k, v in self.headers.items()})
        body = {
            "choices": [{"message": {"role": "assistant", "content": "hi"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
        self._answer(json.dumps(body).encode(), self.headers.get("x-request-id"))

    def _answer(self, body: bytes, request_id: str | None = None) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        if request_id:
            self.send_header("X-Request-Id", request_id)  # as vLLM's --enable-request-id-headers
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def stub_engine() -> Iterator[tuple[str, list[dict[str, str]]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubEngine)
    seen: list[dict[str, str]] = []
    _StubEngine.seen = seen
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_the_request_id_reaches_the_engine_and_comes_back_once(
    procs: Procs, stub_engine: tuple[str, list[dict[str, str]]]
) -> None:
    url, seen = stub_engine
    router = procs.router(models_toml({"m": [url]}))
    chat = {"model": "m", "messages": CHAT}
    kept = httpx.post(
        router.url + "/v1/chat/completions", json=chat, headers={"x-request-id": "r-7"}
    )
    made = httpx.post(router.url + "/v1/chat/completions", json=chat)
    bad = "has spaces " + "x" * 200
    replaced = httpx.post(
        router.url + "/v1/chat/completions", json=chat, headers={"x-request-id": bad}
    )
    for response in (kept, made, replaced):
        assert response.status_code == 200
        assert len(response.headers.get_list("x-request-id")) == 1
    assert kept.headers["x-request-id"] == "r-7"
    ids = [
        kept.headers["x-request-id"],
        made.headers["x-request-id"],
        replaced.headers["x-request-id"],
    ]
    assert len(set(ids)) == 3 and bad not in ids
    assert [s["x-request-id"] for s in seen] == ids
    assert [line["request_id"] for line in access_lines(router, 3)] == ids


def test_json_lines_in_a_file_and_a_log_that_is_off(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "3")
    router = procs.router(
        models_toml({"m": [engine.url]}) + AUTH,
        server='access_log_format = "json"\naccess_log_file = "logs/access.log"',
        wait=False,
    )
    # Relative to the config file's directory, which must exist.
    assert router.popen.wait(30) == 2
    assert f"server.access_log_file: '{procs.tmp}/logs/access.log': no directory" in router.output()
    (procs.tmp / "logs").mkdir()
    router = procs.router(
        models_toml({"m": [engine.url]}) + AUTH,
        server='access_log_format = "json"\naccess_log_file = "logs/access.log"',
    )
    api = client(router.url)
    api.chat.completions.create(model="m", messages=CHAT)
    api.embeddings.create(model="m", input=["a b c"])
    log_file = procs.tmp / "logs" / "access.log"
    deadline = time.monotonic() + 10
    while len(log_file.read_text().splitlines()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    chat, embeddings = (json.loads(line) for line in log_file.read_text().splitlines())
    assert (chat["status"], chat["model"], chat["key_id"]) == (200, "m", KEY_ID)
    assert chat["completion_tokens"] == 3 and chat["prompt_tokens"] > 0
    assert embeddings["path"] == "/v1/embeddings" and embeddings["completion_tokens"] is None
    assert embeddings["prompt_tokens"] == 3
    assert not [line for line in router.output().splitlines() if line.startswith("time=")]
    assert KEY not in log_file.read_text()

    quiet = procs.router(models_toml({"m": [engine.url]}), server="access_log = false")
    client(quiet.url).chat.completions.create(model="m", messages=CHAT)
    quiet.stop()  # a line still held would be written on the way out
    output = quiet.output()
    assert "stopped" in output
    assert not [line for line in output.splitlines() if line.startswith(("time=", "{"))]
