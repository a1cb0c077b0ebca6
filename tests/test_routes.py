"""Which paths the router relays, and the model named in a multipart form (issue 21)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw_core.api_paths import valid_extra_path
from llmgw_core.config import parse_config
from llmgw_core.tomlshape import ConfigError
from llmgw_server.router.routes import (
    MAX_MODEL_BYTES,
    FormRefused,
    Kind,
    Routes,
    form_boundary,
    form_model,
)


def form(boundary: bytes, *parts: tuple[bytes, bytes], end: bool = True) -> bytes:
    """A multipart/form-data body: each part its Content-Disposition params and content."""
    body = b""
    for params, content in parts:
        body += b"--" + boundary + b"\r\nContent-Disposition: form-data; " + params
        body += b"\r\nContent-Type: application/octet-stream\r\n\r\n" + content + b"\r\n"
    return body + (b"--" + boundary + b"--\r\n" if end else b"")


def test_each_path_has_its_kind_and_extra_paths_are_json() -> None:
    routes = Routes(["/v1/custom"])
    assert routes.kind(b"/v1/chat/completions") is Kind.JSON
    assert routes.kind(b"/v1/responses") is Kind.JSON
    assert routes.kind(b"/v1/messages") is Kind.JSON
    assert routes.kind(b"/v1/custom") is Kind.JSON
    assert Routes().kind(b"/v1/custom") is Kind.OTHER
    assert routes.kind(b"/v1/audio/transcriptions") is Kind.FORM
    assert routes.kind(b"/v1/load_lora_adapter") is Kind.MANAGEMENT
    assert routes.kind(b"/slots") is Kind.MANAGEMENT
    assert routes.kind(b"/v1/models") is Kind.OTHER


def test_an_extra_path_must_be_plain_and_never_a_management_path() -> None:
    assert valid_extra_path("/v1/custom") == "/v1/custom"
    for bad in ("v1/custom", "/a?b", "/a b", "/a#b", "/lora-adapters", "/v1/load_lora_adapter"):
        with pytest.raises(ValueError):
            valid_extra_path(bad)


def test_extra_paths_are_checked_where_the_config_is_read() -> None:
    models = [{"name": "m", "endpoints": ["http://127.0.0.1:9001"]}]
    config = parse_config({"router": {"extra_paths": ["/v1/x"]}, "models": models}, "x.toml")
    assert config.router.extra_paths == ("/v1/x",)
    with pytest.raises(ConfigError) as failed:
        parse_config({"router": {"extra_paths": ["/ok", "/slots"]}, "models": models}, "x.toml")
    assert "router.extra_paths[1]" in str(failed.value) and "management" in str(failed.value)


def ct(boundary: bytes) -> bytes:
    return b"multipart/form-data; boundary=" + boundary


def test_the_boundary_is_read_from_a_form_content_type_only() -> None:
    assert form_boundary(b"multipart/form-data; boundary=abc") == b"abc"
    assert form_boundary(b'Multipart/Form-Data ; charset=UTF-8; Boundary="a b"') == b"a b"
    for refused in (
        b"multipart/mixed; boundary=abc",
        b"application/json",
        b"multipart/form-data",
        b"multipart/form-data; boundary=" + b"x" * 71,
        b"multipart/form-data; boundary=a; boundary=b",  # starlette takes the last
        b"multipart/form-data; boundary=a; charset=latin-1",  # starlette decodes in it
        b"multipart/form-data; boundary*=utf-8''a",
        b"multipart/form-data; boundary=a b",  # not a token: quoted or nothing
        None,
    ):
        with pytest.raises(FormRefused):
            form_boundary(refused)


def test_the_model_field_is_found_before_or_after_the_file() -> None:
    audio = b"RIFF\r\n--not-the-boundary\r\n\x00\xff" * 100
    before = form(
        b"XyZ", (b'name="model"', b"whisper-1"), (b'name="file"; filename="a.wav"', audio)
    )
    after = form(b"XyZ", (b'name="file"; filename="a.wav"', audio), (b'name="model"', b"whisper-1"))
    assert form_model(ct(b"XyZ"), before) == "whisper-1"
    assert form_model(ct(b"XyZ"), after) == "whisper-1"
    assert form_model(ct(b"XyZ"), form(b"XyZ", (b'name="file"', audio))) is None
    assert form_model(ct(b"XyZ"), form(b"XyZ", (b"name=model", b"m"))) == "m"  # unquoted


def test_broken_forms_are_refused() -> None:
    good = form(b"b", (b'name="model"', b"m"))
    assert form_model(ct(b"b"), good) == "m"
    long_head = (
        b"--b\r\nX-Pad: "
        + b"p" * 9000
        + b"\r\nContent-Disposition: form-data; name=model\r\n\r\nm\r\n--b--"
    )
    for content_type, body in (
        (ct(b"other"), good),
        (ct(b"b"), good.replace(b"\r\n\r\n", b"\r\n", 1)),  # no head end
        (ct(b"b"), good[: good.index(b"m\r\n--b--")]),  # cut in the value
        (ct(b"b"), form(b"b", (b'name="model"', b"m" * (MAX_MODEL_BYTES + 1)))),
        (ct(b"b"), form(b"b", (b'name="model"', b"\xff\xfe"))),
        (ct(b"b"), long_head),
    ):
        with pytest.raises(FormRefused):
            form_model(content_type, body)


@given(st.binary(max_size=2048), st.binary(min_size=1, max_size=16))
def test_any_bytes_give_a_model_none_or_a_refusal(body: bytes, boundary: bytes) -> None:
    try:
        found = form_model(b'multipart/form-data; boundary="%s"' % boundary, body)
    except FormRefused:
        return
    assert found is None or len(found.encode()) <= MAX_MODEL_BYTES


@given(st.text(min_size=1, max_size=64), st.binary(max_size=512))
def test_a_model_field_anywhere_among_files_is_found(model: str, content: bytes) -> None:
    boundary = b"B0undary-7"
    content = content.replace(b"\r\n--" + boundary, b"")
    body = form(
        boundary, (b'name="file"; filename="x"', content), (b'name="model"', model.encode())
    )
    if b"\r\n--" + boundary not in model.encode() + b"\r\n":
        assert form_model(ct(boundary), body) == model
