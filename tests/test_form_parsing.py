"""A multipart form's model as the router reads it and as the engine reads it (issue 34).

vLLM's (and SGLang's) HTTP layer is FastAPI: starlette parses the form with
python-multipart and FastAPI takes a field with `FormData.get`, the last part of that
name. The router authorizes and routes on the model it reads, so for any form it relays
it must read the model the engine will: fuzzed forms (`name*=`, case, quoting,
whitespace, repeated parts, parameters and headers, padding, charsets, broken framing)
are either refused by the router or give the same model as starlette, whose parser
is fed the body in random pieces as an engine's server receives it. End to end: a key
limited to one model cannot reach another by naming both in a form.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import trio
from hypothesis import example, given, settings
from hypothesis import strategies as st
from starlette.datastructures import Headers
from starlette.formparsers import MultiPartException, MultiPartParser

from hypothesis_profiles import profile_times
from llmgw_core.config import parse_config
from llmgw_http.limits import ServerLimits
from llmgw_http.server import HTTPServer
from llmgw_server.router.routes import (
    MAX_FORM_HEAD_BYTES,
    MAX_FORM_PARTS,
    FormRefused,
    form_model,
)
from llmgw_server.wiring import Running, main
from test_api_surface import ApiEngine, in_thread

REFUSED = "refused"
CT = b"multipart/form-data; boundary=XyZ"


def engine_model(content_type: bytes, body: bytes, cuts: list[int]) -> object:
    """The form's model as vLLM's FastAPI reads it: starlette's MultiPartParser over
    python-multipart, fed the body in the pieces `cuts` makes, then `FormData.get`.
    REFUSED where starlette refuses the form (FastAPI answers 400)."""
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]

    async def stream() -> AsyncGenerator[bytes, None]:
        for piece in pieces:
            yield piece

    async def parse() -> object:
        headers = Headers(raw=[(b"content-type", content_type)])
        form = await MultiPartParser(headers, stream()).parse()
        return form.get("model")

    try:
        return trio.run(parse)
    except MultiPartException:
        return REFUSED


def router_model(content_type: bytes, body: bytes) -> object:
    try:
        return form_model(content_type, body)
    except FormRefused:
        return REFUSED


def agree(content_type: bytes, body: bytes, cuts: list[int]) -> tuple[object, object]:
    """(router's, engine's) model; fails where the router would route a model the engine
    does not read."""
    ours, theirs = router_model(content_type, body), engine_model(content_type, body, cuts)
    # None: the router answers 404 (no model given); "": no model is named "". Either way
    # nothing reaches an engine.
    if ours not in (REFUSED, None, ""):
        assert theirs in (REFUSED, ours), (ours, theirs, content_type, body)
    return ours, theirs


# -- fuzzed forms ------------------------------------------------------------------------
# A well-formed form, then a few pieces of it in a hostile shape each: a form broken
# everywhere tells nothing (both sides refuse it).

SPACE = st.sampled_from([b"", b" ", b"  ", b"\t", b" \t"])
NAMES = st.sampled_from([b"model", b"model", b"file", b"x", b"Model", b"mo"])
VALUES = st.sampled_from([b"public", b"private", b"", b"\xff", b"p\r\nq", b"m\xc3\xa9"])
# What a hostile client does to one part's head, each alone or with others.
PART_TWISTS = st.sampled_from(
    [
        "header case",
        "quoted",
        "unquoted",
        "spaces",
        "filename",
        "other param",
        "repeated name",
        "NAME",
        "name*",
        "name*0",
        "second disposition",
        "content-type",
        "attachment",
        "no disposition",
        "backslash",
        "semicolon inside",
        "trailing semicolon",
        "angle brackets",
    ]
)
FORM_TWISTS = st.sampled_from(
    ["padding", "bad boundary end", "no close", "preamble", "leading CRLF", "second boundary",
     "charset", "boundary*", "byte", "delimiter in value", "epilogue", "quoted boundary"]
)  # fmt: skip


@st.composite
def part_head(draw: st.DrawFn, name: bytes) -> bytes:
    twists = draw(st.sets(PART_TWISTS, max_size=3))
    value = name if "unquoted" in twists else b'"' + name + b'"'
    if "backslash" in twists:
        value = b'"' + name[:1] + b"\\" + name[1:] + b'"'
    if "semicolon inside" in twists:
        value = b'"x;name=' + name + b'"'
    if "angle brackets" in twists:
        value = b"<" + name + b">"
    key = b"NAME" if "NAME" in twists else b"name"
    params = [(key, value)]
    if "filename" in twists or name == b"file":
        params.append((b"filename", b'"a.wav"'))
    if "other param" in twists:
        params.insert(draw(st.integers(0, len(params))), (b"x", b"1"))
    if "repeated name" in twists:
        params.insert(draw(st.integers(0, len(params))), (b"name", draw(NAMES)))
    if "name*" in twists:
        params.insert(draw(st.integers(0, len(params))), (b"name*", b"utf-8''" + draw(NAMES)))
    if "name*0" in twists:
        params.append((b"name*0", draw(NAMES)))
    spaces = "spaces" in twists

    def sep() -> bytes:
        return b";" + draw(SPACE) if spaces else b"; "

    def eq() -> bytes:
        return draw(SPACE) + b"=" + draw(SPACE) if spaces else b"="

    header = b"content-disposition" if "header case" in twists else b"Content-Disposition"
    kind = (
        b"attachment"
        if "attachment" in twists
        else draw(st.sampled_from([b"form-data", b"Form-Data"]))
    )
    line = header + b": " + kind + b"".join(sep() + k + eq() + v for k, v in params)
    if "trailing semicolon" in twists:
        line += b";"
    lines = [] if "no disposition" in twists else [line]
    if "second disposition" in twists:
        lines.insert(
            draw(st.integers(0, len(lines))), b"Content-Disposition: form-data; name=" + draw(NAMES)
        )
    if "content-type" in twists:
        lines.insert(draw(st.integers(0, len(lines))), b"Content-Type: text/plain")
    return b"\r\n".join(lines)


@st.composite
def fuzzed_form(draw: st.DrawFn) -> tuple[bytes, bytes, list[int]]:
    twists = draw(st.sets(FORM_TWISTS, max_size=2))
    boundary = draw(st.sampled_from([b"XyZ", b"XyZ", b"a b", b"--x", b"b;c", b"'()+_,-./:=?"]))
    quoted = "quoted boundary" in twists or any(c in boundary for c in b" ;:=?'()/,")
    ct_params = [b"boundary=" + (b'"' + boundary + b'"' if quoted else boundary)]
    if "second boundary" in twists:
        ct_params.append(
            draw(st.sampled_from([b"boundary=other", b"Boundary=XyZ", b'boundary="XyZ"']))
        )
    if "charset" in twists:
        ct_params.append(
            b"charset="
            + draw(st.sampled_from([b"utf-8", b"UTF8", b"latin-1", b"utf-16", b'"utf-8"']))
        )
    if "boundary*" in twists:
        ct_params.append(b"boundary*=utf-8''other")
    ct_params = draw(st.permutations(ct_params))
    kind = draw(st.sampled_from([b"multipart/form-data", b"Multipart/Form-Data"]))
    content_type = kind + b"".join(b";" + draw(SPACE) + p for p in ct_params)
    body = b"preamble\r\n" if "preamble" in twists else b"\r\n" if "leading CRLF" in twists else b""
    names = draw(st.lists(NAMES, max_size=4))
    for i, name in enumerate(names):
        after = b"\r\n"
        if i == len(names) - 1 and "padding" in twists:
            after = b" \r\n"
        if i == len(names) - 1 and "bad boundary end" in twists:
            after = draw(st.sampled_from([b"\r", b"x\r\n", b"-\r\n"]))
        body += b"--" + boundary + after + draw(part_head(name)) + b"\r\n\r\n" + draw(VALUES)
        if "delimiter in value" in twists and draw(st.booleans()):
            body += b"\r\n--" + boundary + draw(st.sampled_from([b"x", b"-", b" ", b"\r"]))
        body += b"\r\n"
    if "no close" not in twists:
        body += b"--" + boundary + b"--\r\n" + (b"epilogue" if "epilogue" in twists else b"")
    if "byte" in twists and body:
        at = draw(st.integers(0, len(body) - 1))
        body = (
            body[:at]
            + draw(st.sampled_from([b"\r", b"\n", b"-", b";", b'"', b" "]))
            + body[at + 1 :]
        )
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(body) - 1)), max_size=4)))
    return content_type, body, [c for c in cuts if c < len(body)]


@st.composite
def clean_form(draw: st.DrawFn) -> tuple[bytes, bytes, list[int], str | None]:
    """A form as clients send it, and its model (None: it has no model part)."""
    boundary = draw(st.sampled_from([b"XyZ", b"----WebKitFormBoundary7MA4YWxkTrZu0gW", b"a'b"]))
    quote = draw(st.booleans())
    content_type = b"multipart/form-data; boundary=" + (b'"%s"' % boundary if quote else boundary)
    names = draw(st.lists(st.sampled_from(["file", "language", "prompt", "x"]), max_size=4))
    model = draw(
        st.one_of(
            st.none(), st.text(st.characters(codec="utf-8", exclude_characters="\r"), max_size=20)
        )
    )
    if model is not None:
        names.insert(draw(st.integers(0, len(names))), "model")
    body = b""
    for name in names:
        quoted = b'"%s"' % name.encode() if draw(st.booleans()) else name.encode()
        head = b"Content-Disposition: form-data; name=" + quoted
        if name == "file":
            head += b'; filename="a.wav"\r\nContent-Type: audio/wav'
        value = (
            model.encode()
            if name == "model" and model is not None
            else draw(st.binary(max_size=64))
        )
        body += b"--" + boundary + b"\r\n" + head + b"\r\n\r\n" + value + b"\r\n"
    body += b"--" + boundary + b"--\r\n"
    if model is not None and b"\r\n--" + boundary in model.encode() + b"\r\n":
        model = None  # the value itself holds a delimiter: not a clean form
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(body) - 1)), max_size=3)))
    return content_type, body, [c for c in cuts if c < len(body)], model


@settings(max_examples=profile_times(20))
@given(fuzzed_form())
@example(
    (
        CT,
        b"--XyZ\r\nContent-Disposition: form-data; name=model\r\n\r\npublic\r\n"
        b"--XyZ\r\nContent-Disposition: form-data; name=model\r\n\r\nprivate\r\n--XyZ--\r\n",
        [],
    )
)
@example(
    (
        CT,
        b"--XyZ\r\nContent-Disposition: form-data; name=model; name=x\r\n\r\npublic\r\n--XyZ--\r\n",
        [],
    )
)
@example(
    (
        CT,
        b"--XyZ\r\nContent-Disposition: form-data; name=x\r\nContent-Disposition: form-data; name=model\r\n\r\npublic\r\n--XyZ--\r\n",
        [],
    )
)
@example(
    (
        CT,
        b"--XyZ\r\nContent-Disposition: form-data; name=model\r\n\r\npublic\r\n"
        b"--XyZ\r\nContent-Disposition: attachment; name=model\r\n\r\nprivate\r\n--XyZ--\r\n",
        [],
    )
)
@example(
    (
        CT,
        b"--XyZ\r\nContent-Disposition: form-data; name=model\r\n\r\npublic\r\n--XyZ \r\nContent-Disposition: form-data; name=model\r\n\r\nprivate\r\n--XyZ--\r\n",
        [],
    )
)
@example(
    (
        CT + b"; boundary=Q",
        b"--Q\r\nContent-Disposition: form-data; name=model\r\n\r\nprivate\r\n--Q--\r\n",
        [],
    )
)
@example(
    (
        CT + b"; charset=utf-16-le",
        b"--XyZ\r\nContent-Disposition: form-data; name=m\x00o\x00d\x00e\x00l\x00\r\n\r\nprivate\r\n--XyZ--\r\n",
        [],
    )
)
def test_a_fuzzed_form_is_refused_or_read_as_the_engine_reads_it(
    case: tuple[bytes, bytes, list[int]],
) -> None:
    agree(*case)


@settings(max_examples=profile_times(5))
@given(clean_form())
def test_a_form_as_clients_send_it_gives_the_engines_model(
    case: tuple[bytes, bytes, list[int], str | None],
) -> None:
    content_type, body, cuts, model = case
    ours, theirs = agree(content_type, body, cuts)
    assert ours == model
    if model:  # "" is no model to FastAPI, which reads an empty field as missing
        assert theirs == model


@pytest.mark.parametrize(
    ("why", "content_type", "body"),
    [
        ("two model parts", CT, b"--XyZ\r\nContent-Disposition: form-data; name=model\r\n\r\npublic\r\n"
         b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nprivate\r\n--XyZ--\r\n"),
        ("a repeated name", CT, b"--XyZ\r\nContent-Disposition: form-data; name=x; NAME=model\r\n\r\np\r\n--XyZ--\r\n"),
        ("an RFC 2231 name", CT, b"--XyZ\r\nContent-Disposition: form-data; name=x; name*=utf-8''model\r\n\r\np\r\n--XyZ--\r\n"),
        ("two dispositions", CT, b"--XyZ\r\nContent-Disposition: form-data; name=x\r\n"
         b"content-disposition: form-data; name=model\r\n\r\np\r\n--XyZ--\r\n"),
        ("a repeated boundary", CT + b"; boundary=Q", b"--XyZ\r\nContent-Disposition: form-data; name=model\r\n\r\np\r\n--XyZ--\r\n"),
        ("another charset", CT + b"; charset=latin-1", b"--XyZ\r\nContent-Disposition: form-data; name=model\r\n\r\np\r\n--XyZ--\r\n"),
        ("no close", CT, b"--XyZ\r\nContent-Disposition: form-data; name=model\r\n\r\np\r\n"),
        ("padding", CT, b"--XyZ \r\nContent-Disposition: form-data; name=model\r\n\r\np\r\n--XyZ--\r\n"),
        ("not form-data", CT, b"--XyZ\r\nContent-Disposition: attachment; name=model\r\n\r\np\r\n--XyZ--\r\n"),
        ("no name", CT, b"--XyZ\r\nContent-Disposition: form-data\r\n\r\np\r\n--XyZ--\r\n"),
        ("a backslash", CT, b'--XyZ\r\nContent-Disposition: form-data; name="mo\\del"\r\n\r\np\r\n--XyZ--\r\n'),
        ("a preamble", CT, b"x\r\n--XyZ\r\nContent-Disposition: form-data; name=model\r\n\r\np\r\n--XyZ--\r\n"),
        ("not UTF-8", CT, b"--XyZ\r\nContent-Disposition: form-data; name=model\r\n\r\n\xff\r\n--XyZ--\r\n"),
        ("a file model", CT, b'--XyZ\r\nContent-Disposition: form-data; name=model; filename="m"\r\n\r\np\r\n--XyZ--\r\n'),
        ("not a form", b"application/json", b"{}"),
    ],
)  # fmt: skip
def test_what_the_router_refuses(why: str, content_type: bytes, body: bytes) -> None:
    with pytest.raises(FormRefused):
        form_model(content_type, body)


def test_a_form_past_the_scans_bounds_is_refused_not_relayed_and_cheaply() -> None:
    part = b"--XyZ\r\nContent-Disposition: form-data; name=a\r\n\r\n\r\n"
    assert form_model(CT, part * MAX_FORM_PARTS + b"--XyZ--\r\n") is None
    with pytest.raises(FormRefused, match=f"more than {MAX_FORM_PARTS} parts"):
        form_model(CT, part * (MAX_FORM_PARTS + 1) + b"--XyZ--\r\n")
    pad = b"x" * 6000
    fat = b"--XyZ\r\nX-Pad: " + pad + b"\r\nContent-Disposition: form-data; name=a\r\n\r\n\r\n"
    parts = MAX_FORM_HEAD_BYTES // len(fat) + 1
    assert parts <= MAX_FORM_PARTS
    with pytest.raises(FormRefused, match="heads are over"):
        form_model(CT, fat * parts + b"--XyZ--\r\n")
    # The 16 MiB of 1.4M empty parts (1.2 s in the old loop), and as many named
    # ones: each refused within a few milliseconds; 16 MiB of audio scanned the same way.
    empty = b"--XyZ\r\n\r\n\r\n" * 1_400_000 + b"--XyZ--\r\n"
    named = part * (16 * 1024 * 1024 // len(part)) + b"--XyZ--\r\n"
    audio = (
        b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n'
        + b"\r\n--XyY-" * (16 * 1024 * 1024 // 8)  # near misses of the delimiter
        + b"\r\n--XyZ\r\nContent-Disposition: form-data; name=model\r\n\r\nm\r\n--XyZ--\r\n"
    )
    for body in (empty, named):
        started = time.process_time()
        with pytest.raises(FormRefused):
            form_model(CT, body)
        assert time.process_time() - started < 0.1
    started = time.process_time()
    assert form_model(CT, audio) == "m"
    assert time.process_time() - started < 0.5


# -- end to end --------------------------------------------------------------------------

PUBLIC_KEY = "sk-public-only"


@asynccontextmanager
async def router_with_a_limited_key(engine: ApiEngine) -> AsyncIterator[Running]:
    """A router whose models `public` and `private` are one engine (as a model and its
    LoRA adapter are), and whose one key may use `public` only."""
    async with trio.open_nursery() as nursery:
        server = HTTPServer(engine.handle, ServerLimits())
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        await nursery.start(server.serve, listeners)
        url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        config = parse_config(
            {
                "server": {"listen": "127.0.0.1:0"},
                "router": {"health_interval_s": 0.2},
                "auth": {"keys": [{"env": "PUBLIC_KEY", "models": ["public"]}]},
                "models": [
                    {"name": "public", "endpoints": [url]},
                    {"name": "private", "endpoints": [url]},
                ],
            },
            "server.toml",
            environ={"PUBLIC_KEY": PUBLIC_KEY},
        )
        stop = trio.Event()
        running: Running = await nursery.start(lambda **kw: main(config, stop=stop, **kw))
        while not all(b.healthy_count for b in running.router.served.balancers.values()):
            await trio.sleep(0.01)
        yield running
        stop.set()
        nursery.cancel_scope.cancel()


async def test_a_key_for_one_model_cannot_name_another_later_in_a_form() -> None:
    # Old code authorized the first `model` part (public) and relayed the form, whose
    # last one (private) is what vLLM's FastAPI serves: 200 from the private model.
    engine = ApiEngine()
    headers = {"authorization": f"Bearer {PUBLIC_KEY}", "content-type": CT.decode()}

    def form(*models: bytes) -> bytes:
        body = b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF\r\n'
        for model in models:
            body += (
                b'--XyZ\r\nContent-Disposition: form-data; name="model"\r\n\r\n' + model + b"\r\n"
            )
        return body + b"--XyZ--\r\n"

    with trio.fail_after(30):
        async with router_with_a_limited_key(engine) as running:
            base = f"http://127.0.0.1:{running.port}/v1/audio"
            for path in ("transcriptions", "translations"):
                both = await in_thread(
                    lambda path=path: httpx.post(  # type: ignore[misc]
                        f"{base}/{path}", content=form(b"public", b"private"), headers=headers
                    )
                )
                assert both.status_code == 400, both.text
                assert "the form names its model more than once" in both.json()["error"]["message"]
            assert not engine.requests(b"/v1/audio/transcriptions")
            assert not engine.requests(b"/v1/audio/translations")
            # The same key with one model part: the allowed one is relayed, the other not.
            public = await in_thread(
                lambda: httpx.post(
                    f"{base}/transcriptions", content=form(b"public"), headers=headers
                )
            )
            assert public.json() == {"text": hashlib.sha256(form(b"public")).hexdigest()}
            private = await in_thread(
                lambda: httpx.post(
                    f"{base}/transcriptions", content=form(b"private"), headers=headers
                )
            )
            assert private.status_code == 403
    assert len(engine.requests(b"/v1/audio/transcriptions")) == 1
