"""The model catalog: the one place where a model entry is validated.

The router reads static endpoints from it; the control plane (later) reads the
same entries for profiles.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import attrs

from llmgw_core.tomlshape import Table

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")


@attrs.frozen
class Endpoint:
    """An engine's root URL, such as http://10.0.0.5:8000."""

    host: str
    port: int
    prefix: str = ""  # a path prefix when the engine sits behind a path-routing proxy

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.prefix}"

    def __str__(self) -> str:
        return self.url


def parse_endpoint(text: str) -> Endpoint:
    """Parse an engine URL; raises ValueError with what is wrong."""
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a valid URL: {exc}") from None
    if parts.scheme != "http":
        raise ValueError(f"{text!r} must start with http:// (engines are reached over plain HTTP)")
    if not parts.hostname:
        raise ValueError(f"{text!r} has no host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{text!r} must not have a query, fragment or user")
    prefix = parts.path.rstrip("/")
    if prefix.endswith("/v1"):
        raise ValueError(f"{text!r}: give the engine's root URL, without /v1")
    return Endpoint(host=parts.hostname, port=port or 80, prefix=prefix)


@attrs.frozen
class ModelEntry:
    name: str
    endpoints: tuple[Endpoint, ...]


@attrs.frozen
class Catalog:
    models: tuple[ModelEntry, ...]

    def get(self, name: str) -> ModelEntry | None:
        for model in self.models:
            if model.name == name:
                return model
        return None


def read_catalog(root: Table) -> Catalog:
    """Read and validate every `[[models]]` entry of a config file."""
    models: list[ModelEntry] = []
    seen: dict[str, str] = {}
    for table in root.tables("models"):
        entry = _read_model(table)
        if entry.name in seen:
            table.fail("name", f"duplicates the model name {entry.name!r} of {seen[entry.name]}")
        seen[entry.name] = table.path
        models.append(entry)
    return Catalog(models=tuple(models))


def _read_model(table: Table) -> ModelEntry:
    name = table.text("name")
    if not _MODEL_NAME.match(name):
        table.fail("name", f"{name!r} is not a valid model name (letters, digits, ._:/@+-)")
    raw = table.texts("endpoints", ())
    if not raw:
        table.fail("endpoints", "is required: list the engines' URLs")
    endpoints: list[Endpoint] = []
    for i, text in enumerate(raw):
        try:
            endpoint = parse_endpoint(text)
        except ValueError as exc:
            table.fail(f"endpoints[{i}]", str(exc))
        if endpoint in endpoints:
            table.fail(f"endpoints[{i}]", f"{text!r} is listed twice")
        endpoints.append(endpoint)
    table.finish()
    return ModelEntry(name=name, endpoints=tuple(endpoints))
