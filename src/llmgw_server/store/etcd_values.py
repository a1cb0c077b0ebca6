"""The values of etcd's v3 API as the client hands them out (keys, leases, a
transaction's guards and operations, watch events, a member's status), and their JSON
as etcd's gateway writes it: proto3's, where keys and values are base64, int64s are
strings, and a field at its zero value (0, false, empty) is absent. Pure: the decoders
raise KeyError, TypeError or ValueError on a document that is not etcd's, and the client
(store/etcd.py) says so in one line.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any, Literal

import attrs


@attrs.frozen
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int  # 0 for a deleted key (a delete event's kv)
    lease: int


@attrs.frozen
class Lease:
    id: int
    ttl_s: int


CompareTarget = Literal["CREATE", "MOD", "VERSION", "VALUE", "LEASE"]
CompareResult = Literal["EQUAL", "NOT_EQUAL", "GREATER", "LESS"]
# The field of a Compare that carries its value, by target.
_COMPARE_FIELD = {
    "CREATE": "create_revision",
    "MOD": "mod_revision",
    "VERSION": "version",
    "VALUE": "value",
    "LEASE": "lease",
}


@attrs.frozen
class Compare:
    """One guard of a transaction. A key that does not exist has create revision,
    mod revision, version and lease 0."""

    key: bytes
    target: CompareTarget
    result: CompareResult
    value: int | bytes

    @classmethod
    def create_revision(cls, key: bytes, equals: int) -> Compare:
        return cls(key, "CREATE", "EQUAL", equals)

    @classmethod
    def mod_revision(cls, key: bytes, equals: int) -> Compare:
        return cls(key, "MOD", "EQUAL", equals)

    @classmethod
    def version(cls, key: bytes, equals: int) -> Compare:
        return cls(key, "VERSION", "EQUAL", equals)

    @classmethod
    def lease(cls, key: bytes, equals: int) -> Compare:
        return cls(key, "LEASE", "EQUAL", equals)

    @classmethod
    def value_is(cls, key: bytes, equals: bytes) -> Compare:
        return cls(key, "VALUE", "EQUAL", equals)

    def to_json(self) -> dict[str, str]:
        value = b64(self.value) if isinstance(self.value, bytes) else str(self.value)
        return {
            "key": b64(self.key),
            "target": self.target,
            "result": self.result,
            _COMPARE_FIELD[self.target]: value,
        }


@attrs.frozen
class Op:
    """A put, a delete or a read inside a transaction."""

    kind: Literal["put", "delete", "get"]
    key: bytes
    value: bytes = b""
    lease: int = 0
    prefix: bool = False

    @classmethod
    def put(cls, key: bytes, value: bytes, lease: int = 0) -> Op:
        return cls("put", key, value, lease=lease)

    @classmethod
    def delete(cls, key: bytes, prefix: bool = False) -> Op:
        return cls("delete", key, prefix=prefix)

    @classmethod
    def get(cls, key: bytes, prefix: bool = False) -> Op:
        return cls("get", key, prefix=prefix)

    def to_json(self) -> dict[str, dict[str, str]]:
        if self.kind == "put":
            return {
                "request_put": {
                    "key": b64(self.key),
                    "value": b64(self.value),
                    "lease": str(self.lease),
                }
            }
        name = "request_delete_range" if self.kind == "delete" else "request_range"
        return {name: key_range(self.key, self.prefix)}


@attrs.frozen
class TxnResult:
    succeeded: bool
    revision: int
    # The kvs each read of the branch that ran found, in order; () for a put or a delete.
    responses: tuple[tuple[KeyValue, ...], ...]


@attrs.frozen
class WatchEvent:
    kind: Literal["put", "delete"]
    kv: KeyValue
    revision: int  # the revision that made the change (kv.mod_revision)


@attrs.frozen
class EndpointStatus:
    url: str
    ok: bool
    leader: bool  # this member leads etcd's own raft
    revision: int
    latency_s: float
    error: str = ""


def prefix_end(prefix: bytes) -> bytes:
    """The end of the key range of every key beginning with `prefix` (etcd's range_end)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"  # every key
    end[-1] += 1
    return bytes(end)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(value: object) -> bytes:
    if value is None:
        return b""
    if not isinstance(value, str):
        raise TypeError("base64 text expected")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error:
        raise ValueError("not base64") from None


def proto_int(value: object) -> int:
    """A proto3 JSON integer: absent is 0, an int64 comes as a string."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise TypeError("an integer expected")
    return int(value)


def int_or_zero(value: object) -> int:
    try:
        return proto_int(value)
    except (TypeError, ValueError):
        return 0


def mapping(value: object) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError("an object expected")
    return value


def key_range(key: bytes, prefix: bool) -> dict[str, str]:
    body = {"key": b64(key)}
    if prefix:
        body["range_end"] = b64(prefix_end(key))
    return body


def kv_of(doc: object) -> KeyValue:
    d = mapping(doc)
    return KeyValue(
        key=unb64(d.get("key")),
        value=unb64(d.get("value")),
        create_revision=proto_int(d.get("create_revision")),
        mod_revision=proto_int(d.get("mod_revision")),
        version=proto_int(d.get("version")),
        lease=proto_int(d.get("lease")),
    )


def kvs_of(doc: Mapping[str, Any]) -> list[KeyValue]:
    return [kv_of(kv) for kv in doc.get("kvs") or ()]


def doc_of(doc: dict[str, Any]) -> dict[str, Any]:
    return doc


def revision_of(doc: Mapping[str, Any]) -> int:
    """The store's revision an answer was made at (every answer of etcd's has one, from 1
    on; a watch message may not)."""
    revision = proto_int(mapping(doc.get("header")).get("revision"))
    if revision < 1:
        raise ValueError("no revision")
    return revision


def range_of(doc: dict[str, Any]) -> tuple[list[KeyValue], int]:
    return kvs_of(doc), revision_of(doc)


def page_of(doc: dict[str, Any]) -> tuple[list[KeyValue], int, bool]:
    return kvs_of(doc), revision_of(doc), bool(doc.get("more"))


def lease_of(doc: dict[str, Any]) -> Lease:
    lease = Lease(id=proto_int(doc.get("ID")), ttl_s=proto_int(doc.get("TTL")))
    if not lease.id:
        raise ValueError("no lease")
    return lease


def token_of(doc: dict[str, Any]) -> str:
    token = doc["token"]
    if not isinstance(token, str) or not token or not token.isprintable():
        raise ValueError("no token")
    return token


def keepalive_ttl_of(doc: dict[str, Any]) -> int:
    # A stream of one answer: {"result": {"ID": ..., "TTL": ...}} (no TTL: the lease is gone).
    return proto_int(mapping(doc["result"]).get("TTL"))


def txn_result_of(doc: dict[str, Any]) -> TxnResult:
    responses = []
    for response in doc.get("responses") or ():
        found = mapping(response).get("response_range")
        responses.append(tuple(kvs_of(mapping(found))) if found is not None else ())
    return TxnResult(bool(doc.get("succeeded")), revision_of(doc), tuple(responses))
