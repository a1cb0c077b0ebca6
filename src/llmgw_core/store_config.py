"""The `[control.store]` section: the etcd cluster that keeps a control plane's state, so
that any number of control planes run from one config, one leading and the others
standing by (docs/high-availability.md). Without it, one control plane runs alone with
its state in memory, as before.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from llmgw_core.config_schema import Problem, read_texts, rule_after, rules
from llmgw_core.tls_config import _FILE


def _endpoints(value: object) -> tuple[str, ...]:
    urls = tuple(read_texts(value))
    if not urls:
        raise Problem("name at least one etcd client URL, e.g. http://127.0.0.1:2379")
    for i, url in enumerate(urls):
        if not url.startswith(("http://", "https://")) or url.rstrip("/").count("/") != 2:
            raise Problem(
                f"{url!r} is not an etcd client URL (http://HOST:PORT or https://HOST:PORT)",
                f"[{i}]",
            )
    return tuple(url.rstrip("/") for url in urls)


def _prefix(prefix: str) -> str:
    if not prefix.startswith("/") or not prefix.endswith("/") or "//" in prefix:
        raise Problem(f"must start and end with '/' (e.g. /llmgw/prod/), not {prefix!r}")
    return prefix


def _advertise(url: str) -> str:
    if url and (not url.startswith(("ws://", "wss://")) or url.rstrip("/").count("/") != 2):
        raise Problem(f"must be ws://HOST:PORT or wss://HOST:PORT, not {url!r}")
    return url.rstrip("/")


@attrs.frozen
class StoreSection:
    # The etcd members' client URLs; any that answers serves (etcd forwards to its leader).
    endpoints: tuple[str, ...] = attrs.field(metadata=rules(parse=_endpoints))
    # Every key this fleet writes begins with it: several fleets share one etcd cluster.
    prefix: str = attrs.field(default="/llmgw/default/", metadata=rules(check=_prefix))
    # The leader's lease: a leader that could not renew it for this long steps down, and
    # a standby leads after it ends. Longer than the stalls a busy machine gives a
    # process (a SIGKILLed leader is replaced within about this long).
    lease_ttl_s: float = attrs.field(default=10.0, metadata=rules(min=2.0, max=300.0))
    # This control plane's URL as agents, routers and operators reach it (ws:// or wss://
    # HOST:PORT), given per process (`llmgw-server --advertise`): a standby names the leader's
    # to its peers. Default: control_listen's host and port.
    advertise: str = attrs.field(default="", metadata=rules(check=_advertise))
    # etcd's own authentication: a user, with its password in this environment variable.
    user: str = ""
    password_env: str = ""
    # https endpoints: the CA that signed etcd's certificate, and a client certificate.
    ca: Path | None = attrs.field(default=None, metadata=_FILE)
    cert: Path | None = attrs.field(default=None, metadata=_FILE)
    key: Path | None = attrs.field(default=None, metadata=_FILE)

    def password(self) -> str:
        """The password, read from `password_env` when the store is dialed."""
        return os.environ.get(self.password_env, "") if self.password_env else ""


@rule_after(StoreSection)
def _store_rules(s: StoreSection) -> None:
    if bool(s.user) != bool(s.password_env):
        raise Problem("user and password_env go together", "user" if not s.user else "password_env")
    if (s.cert is None) != (s.key is None):
        raise Problem("cert and key go together", "cert" if s.cert is None else "key")
    tls = any(url.startswith("https://") for url in s.endpoints)
    if not tls and (s.ca or s.cert):
        raise Problem("ca and cert are for https:// endpoints", "ca" if s.ca else "cert")
