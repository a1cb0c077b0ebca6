"""Config sections declared once: attrs classes structured by cattrs.

A config section is an attrs class whose fields carry their file rules in metadata
(`rules(min=..., parse=..., ...)`); `structure()` reads a table into it through one
cattrs converter, `CONVERTER`. Its type hooks give the messages for wrong types ("must
be an integer, not a string"); the per-field rules add bounds and checks; each class's
hook reports unknown keys with a "did you mean" and missing required ones with a
"misspelling" hint; rules across fields are registered with `rule_before` (on the raw
table) and `rule_after` (on the structured section). cattrs collects every problem in
an ExceptionGroup; `structure` turns the first one into a ConfigError naming file, key
path and what is wrong, as `tomlshape.Table` does.
"""

from __future__ import annotations

import contextvars
import hashlib
import math
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import attrs
import cattrs
import cattrs.errors
import cattrs.gen

from llmgw_core.tomlshape import ConfigError, Table, did_you_mean, type_name

T = TypeVar("T")
_RULES = "llmgw_config"


class Problem(ValueError):
    """What is wrong with a value; `key` names the part of it at fault (`"env.X"`,
    `"[2]"`), None for the value itself."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.key = key


@attrs.frozen
class Rules:
    """How one field is read from its table (see `rules`)."""

    min: float | None = None
    max: float | None = None
    # Reads the file's value instead of the field type's hook (a field that takes more
    # than one type, or a digest); raises Problem.
    parse: Callable[[object], object] | None = None
    # Checks or adjusts the value after it was read; returns the value, raises Problem.
    check: Callable[[Any], object] | None = None
    # The field holds a secret's digest: the file gives it at the field's key, or names
    # an environment variable at this key instead, whose value is hashed when read.
    secret_env: str | None = None
    in_file: bool = True  # False: set by the program, never by the file
    key: str | None = None  # the file's key, when it is not the field's name


def rules(
    *,
    min: float | None = None,
    max: float | None = None,
    parse: Callable[[object], object] | None = None,
    check: Callable[[Any], object] | None = None,
    secret_env: str | None = None,
    in_file: bool = True,
    key: str | None = None,
) -> dict[str, Rules]:
    """Field metadata: `attrs.field(default=1.0, metadata=rules(min=0.1))`."""
    return {_RULES: Rules(min, max, parse, check, secret_env, in_file, key)}


class _Before(Protocol):
    def __call__(self, data: dict[str, object], /) -> None: ...


_BEFORE: dict[type, _Before] = {}
_AFTER: dict[type, Callable[[Any], None]] = {}


def rule_before(cls: type) -> Callable[[_Before], _Before]:
    """Register a check of a table's raw data (a copy), run before its fields are read (a
    rule on which keys go together). It raises Problem with the key at fault."""

    def register(fn: _Before) -> _Before:
        _BEFORE[cls] = fn
        return fn

    return register


def rule_after(cls: type[T]) -> Callable[[Callable[[T], None]], Callable[[T], None]]:
    """Register a check across a section's fields, run once all of them were read."""

    def register(fn: Callable[[T], None]) -> Callable[[T], None]:
        _AFTER[cls] = fn
        return fn

    return register


@attrs.frozen
class _Reading:
    base_dir: Path
    environ: Mapping[str, str]


_READING: contextvars.ContextVar[_Reading] = contextvars.ContextVar("llmgw_config_reading")


def reading_environ() -> Mapping[str, str]:
    """The environment that `*_env` keys are read from, during `structure`."""
    return _READING.get().environ


def reading_base_dir() -> Path:
    """The directory relative paths are taken from, during `structure`."""
    return _READING.get().base_dir


def read_text(value: object, _: object = None) -> str:
    if not isinstance(value, str):
        raise Problem(f"must be a string, not {type_name(value)}")
    if not value.strip():
        raise Problem("must not be empty")
    return value


def read_boolean(value: object, _: object = None) -> bool:
    if not isinstance(value, bool):
        raise Problem(f"must be true or false, not {type_name(value)}")
    return value


def read_integer(value: object, _: object = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Problem(f"must be an integer, not {type_name(value)}")
    return value


def read_number(value: object, _: object = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Problem(f"must be a number, not {type_name(value)}")
    if not math.isfinite(value):
        raise Problem(f"must be a finite number, not {value}")
    return float(value)


def read_path(value: object, _: object = None) -> Path:
    """A relative path is taken from the config file's directory; `~` is the home
    directory. Whether it exists is for the section's rules."""
    text = read_text(value)
    try:
        path = Path(text).expanduser()
    except RuntimeError as exc:  # ~user of no such user, or no home directory
        raise Problem(f"{text!r}: {exc}") from None
    return path if path.is_absolute() else reading_base_dir() / path


def read_texts(value: object, _: object = None) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise Problem(f"must be an array of strings, not {type_name(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise Problem(f"must be a string, not {type_name(item)}", f"[{i}]")
    return tuple(value)


def read_labels(value: object, _: object = None) -> dict[str, str]:
    if not isinstance(value, dict):
        raise Problem(f"must be a table of strings, not {type_name(value)}")
    for k, v in value.items():
        if not isinstance(v, str):
            raise Problem(f"must be a string, not {type_name(v)}", k)
    return dict(value)


def read_digest(value: object) -> str:
    """A `sha256:<64 hex>` digest as the file gives it, kept as the bare hex digits."""
    return checked_digest(read_text(value))


def checked_digest(text: str) -> str:
    if not _DIGEST.match(text):
        raise Problem(f"must be 'sha256:' and 64 lowercase hex digits ({_HASH_HINT})")
    return text.removeprefix("sha256:")


def digest_of(secret: str | bytes) -> str:
    """The hex SHA-256 digest under which a key or token is kept."""
    data = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(data).hexdigest()


def secret_from_env(value: object) -> str:
    """The digest of the secret held by the environment variable named by `value`."""
    name = read_text(value)
    secret = reading_environ().get(name)
    if secret is None:
        raise Problem(f"the environment variable {name} is not set")
    if not secret.strip():
        raise Problem(f"the environment variable {name} is empty")
    return digest_of(secret.strip())


_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_HASH_HINT = "make one with: python -m llmgw_server hash-key"


class _FromEnv(str):
    """A digest already made from an environment variable (not a `sha256:` text)."""


def _field_type(field: attrs.Attribute[Any]) -> Any:
    """The field's type without `| None`: TOML has no null, so None is only ever a default."""
    tp = field.type
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _table_list_hook(
    converter: cattrs.Converter, name: str, item: type
) -> Callable[[object, object], tuple[Any, ...]]:
    def read(value: object, _: object) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise Problem(f"must be an array of tables ([[{name}]]), not {type_name(value)}")
        items: list[Any] = []
        errors: list[Exception] = []
        for i, entry in enumerate(value):
            try:
                items.append(converter.structure(entry, item))
            except Exception as exc:
                exc.__notes__ = [*getattr(exc, "__notes__", []), _index_note(i, item)]
                errors.append(exc)
        if errors:
            raise cattrs.IterableValidationError(f"While structuring [[{name}]]", errors, tuple)
        return tuple(items)

    return read


def _index_note(index: int, item: type) -> cattrs.errors.IterableValidationNote:
    return cattrs.errors.IterableValidationNote(f"Structuring item @ index {index}", index, item)


def _field_hook(
    converter: cattrs.Converter, field: attrs.Attribute[Any]
) -> Callable[[object, object], object]:
    spec: Rules = field.metadata.get(_RULES, Rules())
    tp = _field_type(field)
    read: Callable[[object, object], object]
    if spec.parse is not None:
        parse = spec.parse
        read = lambda value, _: parse(value)  # noqa: E731
    elif typing.get_origin(tp) is tuple and attrs.has(typing.get_args(tp)[0]):
        read = _table_list_hook(converter, spec.key or field.name, typing.get_args(tp)[0])
    else:
        read = converter.get_structure_hook(tp)
    if spec.min is None and spec.max is None and spec.check is None:
        return read
    low, high, check = spec.min, spec.max, spec.check

    def read_and_check(value: object, tp: object) -> object:
        result: Any = read(value, tp)
        if low is not None and result < low:
            raise Problem(f"must be at least {low}, not {value}")
        if high is not None and result > high:
            raise Problem(f"must be at most {high}, not {value}")
        return check(result) if check is not None else result

    return read_and_check


def _misspelling(key: str, unknown: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(key, unknown, n=1)
    return f" (is {close[0]!r} a misspelling of it?)" if close else ""


def _section_hook(converter: cattrs.Converter, cls: type) -> Callable[[object, object], Any]:
    attrs.resolve_types(cls)
    fields = [f for f in attrs.fields(cls) if f.init]
    specs = {f.name: f.metadata.get(_RULES, Rules()) for f in fields}
    overrides = {
        f.name: cattrs.gen.override(struct_hook=_field_hook(converter, f), rename=specs[f.name].key)
        if specs[f.name].in_file
        else cattrs.gen.override(omit=True)
        for f in fields
    }
    read_fields: Callable[[Mapping[str, Any], Any], Any] = cattrs.gen.make_dict_structure_fn(
        cls,
        converter,
        _cattrs_forbid_extra_keys=False,
        _cattrs_detailed_validation=True,
        **overrides,  # type: ignore[arg-type]
    )
    in_file = [spec.key or name for name, spec in specs.items() if spec.in_file]
    secrets = [
        (spec.key or name, spec.secret_env) for name, spec in specs.items() if spec.secret_env
    ]
    # A key "ports.min" is the key min of the table [ports], which holds only such keys.
    nested: dict[str, set[str]] = {}
    for key in in_file:
        head, dot, tail = key.partition(".")
        if dot:
            nested.setdefault(head, set()).add(tail)
    known = {k for k in in_file if "." not in k} | set(nested)
    known |= {env_key for _, env_key in secrets}
    renamed = {name: spec.key for name, spec in specs.items() if spec.key}
    before, after = _BEFORE.get(cls), _AFTER.get(cls)

    def read(value: object, _: object) -> Any:
        if not isinstance(value, dict):
            raise Problem(f"must be a table, not {type_name(value)}")
        unknown = sorted(k for k in value if k not in known)
        data, errors = dict(value), list[Exception]()
        if before is not None:
            before(data)
        for digest_key, env_key in secrets:
            _read_secret(data, digest_key, env_key, errors)
        table_errors = [e for head, keys in nested.items() for e in _flatten(data, head, keys)]
        result = None
        try:
            result = read_fields(data, cls)
        except cattrs.ClassValidationError as group:
            errors += [_required_hint(_file_keys(e, renamed), unknown) for e in group.exceptions]
        errors += table_errors
        if unknown:
            hint = did_you_mean(unknown[0], known)
            errors.append(Problem("is not a known key" + hint, unknown[0] or None))
        if errors:
            raise cattrs.ClassValidationError(f"While structuring {cls.__name__}", errors, cls)
        if after is not None:
            after(result)
        return result

    return read


def _flatten(data: dict[str, object], head: str, keys: set[str]) -> Iterator[Problem]:
    """Lift the keys of the table `head` into `data` as "head.key"."""
    if head not in data:
        return
    table = data.pop(head)
    if not isinstance(table, dict):
        yield Problem(f"must be a table, not {type_name(table)}", head)
        return
    extra = sorted(k for k in table if k not in keys)
    if extra:
        hint = did_you_mean(extra[0], keys)
        yield Problem("is not a known key" + hint, f"{head}.{extra[0]}")
    for key in keys & table.keys():
        data[f"{head}.{key}"] = table[key]


def _read_secret(
    data: dict[str, object], digest_key: str, env_key: str, errors: list[Exception]
) -> None:
    """The key naming an environment variable is replaced by the digest key, holding the
    digest of the variable's value."""
    if env_key not in data:
        return
    if digest_key in data:
        errors.append(Problem(f"give {digest_key} or {env_key}, not both", env_key))
        del data[env_key]
        return
    try:
        data[digest_key] = _FromEnv(secret_from_env(data.pop(env_key)))
    except Problem as problem:
        errors.append(Problem(problem.message, env_key))


def _file_keys(error: Exception, renamed: Mapping[str, str]) -> Exception:
    """cattrs' notes name the attribute; the file's key is what the user wrote."""
    notes = getattr(error, "__notes__", None)
    if notes and renamed:
        error.__notes__ = [
            cattrs.errors.AttributeValidationNote(str(n), renamed[n.name], n.type)
            if isinstance(n, cattrs.errors.AttributeValidationNote) and n.name in renamed
            else n
            for n in notes
        ]
    return error


def _required_hint(error: Exception, unknown: list[str]) -> Exception:
    """cattrs reports a missing key as a KeyError: say it is required, and point at an
    unknown key that looks like its misspelling."""
    if not isinstance(error, KeyError):
        return error
    notes = getattr(error, "__notes__", [])
    names = [n.name for n in notes if isinstance(n, cattrs.errors.AttributeValidationNote)]
    key = names[0] if names else str(error.args[0])
    problem = Problem("is required" + _misspelling(key, unknown), key)
    return problem


def digest_hook(value: object) -> str:
    """A field's `parse` for a digest given as `sha256:...` or made from `<base>_env`."""
    return str(value) if isinstance(value, _FromEnv) else read_digest(value)


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(detailed_validation=True)
    converter.register_structure_hook(str, read_text)
    converter.register_structure_hook(bool, read_boolean)
    converter.register_structure_hook(int, read_integer)
    converter.register_structure_hook(float, read_number)
    converter.register_structure_hook(Path, read_path)
    # Generic aliases are matched by equality: functools' dispatch takes classes only.
    converter.register_structure_hook_func(lambda tp: tp == tuple[str, ...], read_texts)
    converter.register_structure_hook_func(lambda tp: tp == dict[str, str], read_labels)
    converter.register_structure_hook_factory(attrs.has, lambda cls: _section_hook(converter, cls))
    return converter


CONVERTER = _make_converter()


def _paths(exc: BaseException, path: str) -> Iterator[tuple[str, str]]:
    """(key path, what is wrong) for every problem in cattrs' nested exception groups,
    in the order of the fields."""
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            yield from _paths(sub, _join_notes(path, sub))
    elif isinstance(exc, Problem):
        yield _join(path, exc.key), exc.message
    else:
        yield path, f"is not valid: {exc}"


_INDEX = re.compile(r"\[[0-9]+\]")


def _join(path: str, key: str | None) -> str:
    if key is None:
        return path
    if _INDEX.match(key) or not path:  # "[2]", or "[2].key_env" from an item's table
        return path + key
    return f"{path}.{key}"


def _join_notes(path: str, exc: BaseException) -> str:
    # Each level of structuring appends its note: the outermost comes last.
    for note in reversed(getattr(exc, "__notes__", [])):
        if isinstance(note, cattrs.errors.AttributeValidationNote):
            path = _join(path, note.name)
        elif isinstance(note, cattrs.errors.IterableValidationNote):
            path = _join(path, f"[{note.index}]")
    return path


def structure(
    data: object,
    cls: type[T],
    *,
    file: str,
    path: str = "",
    base_dir: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """Read `data` (the table at `path` of `file`) into the section `cls`; the first
    problem found is raised as a ConfigError naming its key path."""
    if base_dir is None:
        base_dir = Path(os.path.abspath(file)).parent if file else Path.cwd()
    token = _READING.set(_Reading(base_dir, os.environ if environ is None else environ))
    try:
        return CONVERTER.structure(data, cls)
    except (Problem, cattrs.BaseValidationError) as exc:
        where, message = next(_paths(exc, path))
        raise ConfigError(file, where, message) from None
    finally:
        _READING.reset(token)


def read_item(value: object, cls: type[T], index: int) -> T:
    """The table at `[index]` of an array that also holds other values (a `parse`
    function's item), read into the section `cls`; its first problem is raised as a
    Problem whose key path starts at `[index]`."""
    try:
        return CONVERTER.structure(value, cls)
    except (Problem, cattrs.BaseValidationError) as exc:
        where, message = next(_paths(exc, f"[{index}]"))
        raise Problem(message, where) from None


def read_table(
    table: Table,
    cls: type[T],
    *,
    keys: Iterable[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """Read a `Table` into the section `cls`: all of it, or only `keys` (absent ones are
    left out), the others being for other sections. Those keys count as read."""
    wanted = list(table.data if keys is None else keys)
    table.known(*wanted)
    data = {k: table.data[k] for k in wanted if k in table.data}
    return structure(
        data, cls, file=table.file, path=table.path, base_dir=table.base_dir, environ=environ
    )
