"""Reading user-written TOML tables with errors that name the key path.

`ConfigError` says file, key path and what is wrong. The config sections are declared
once as attrs classes and read by `config_schema`; `Table` is the root table they are
read from (and the hand-written reader of the simulated inventory files).
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn


class ConfigError(Exception):
    """A config file that cannot be used; `str()` is the whole message for the user."""

    def __init__(self, file: str, path: str, message: str) -> None:
        self.file = file
        self.path = path
        self.message = message
        where = f"{file}: {path}" if path else file
        super().__init__(f"{where}: {message}")


_MISSING: Any = object()


def load_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file's data; a file that is missing, unreadable or not TOML raises ConfigError."""
    file = str(path)
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(file, "", "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(file, "", f"cannot be read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(file, "", f"is not valid TOML: {exc}") from None


def type_name(value: object) -> str:
    """How a message names the TOML type of `value`: "an integer", "a table"."""
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "a table",
    }.get(type(value), type(value).__name__)


class Table:
    """One TOML table being read; keys that are never read are reported by `finish`.

    `file` names the config file in messages and anchors its relative paths (`file_path`):
    those are taken from the file's directory, never from the working directory, so that a
    config means the same under a service manager as in a shell. A `file` that is not a
    real path (a test's `"<test>"`) anchors them in the working directory.
    """

    def __init__(
        self, data: Mapping[str, Any], file: str, path: str = "", *, base_dir: Path | None = None
    ) -> None:
        self._data = data
        self._file = file
        self.path = path
        self._read: set[str] = set()
        self._base_dir = base_dir

    @property
    def base_dir(self) -> Path:
        """The directory that relative paths in this file are taken from."""
        if self._base_dir is None:
            self._base_dir = Path(os.path.abspath(self._file)).parent if self._file else Path.cwd()
        return self._base_dir

    def _key_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str | None, message: str) -> NoReturn:
        if key is not None and key not in self._data and message.startswith("is required"):
            message += self._typo_hint(key)
        raise ConfigError(self._file, self._key_path(key) if key else self.path, message)

    def key_names(self) -> list[str]:
        return list(self._data)

    def has(self, key: str) -> bool:
        return key in self._data

    def raw(self, key: str) -> Any:
        """The value at `key` as the file has it, for a key that takes more than one type."""
        return self._data[key]

    def _get(self, key: str, default: Any) -> Any:
        self._read.add(key)
        if key in self._data:
            return self._data[key]
        if default is _MISSING:
            self.fail(key, "is required")
        return default

    def _typo_hint(self, key: str) -> str:
        """Point at an unknown key that looks like a misspelling of `key`."""
        import difflib

        unread = [k for k in self._data if k not in self._read]
        close = difflib.get_close_matches(key, unread, n=1)
        return f" (is {close[0]!r} a misspelling of it?)" if close else ""

    def text(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, str):
            self.fail(key, f"must be a string, not {type_name(value)}")
        if not value.strip():
            self.fail(key, "must not be empty")
        return value

    def file_path(self, key: str, default: Any = _MISSING) -> Any:
        """A path in the file system; a relative one is taken from the config file's
        directory, and `~` is the home directory. Whether it exists is for the caller."""
        value = self.text(key, default)
        if value is default and default is not _MISSING:
            return value
        try:
            path = Path(value).expanduser()
        except RuntimeError as exc:  # ~user of no such user, or no home directory
            self.fail(key, f"{value!r}: {exc}")
        return path if path.is_absolute() else self.base_dir / path

    def boolean(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, bool):
            self.fail(key, f"must be true or false, not {type_name(value)}")
        return value

    def integer(self, key: str, default: Any = _MISSING, *, min: int | None = None) -> Any:
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, f"must be an integer, not {type_name(value)}")
        if min is not None and value < min:
            self.fail(key, f"must be at least {min}, not {value}")
        return value

    def number(self, key: str, default: Any = _MISSING, *, min: float | None = None) -> Any:
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(key, f"must be a number, not {type_name(value)}")
        if not math.isfinite(value):
            self.fail(key, f"must be a finite number, not {value}")
        if min is not None and value < min:
            self.fail(key, f"must be at least {min}, not {value}")
        return float(value)

    def texts(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, list):
            self.fail(key, f"must be an array of strings, not {type_name(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                self.fail(f"{key}[{i}]", f"must be a string, not {type_name(item)}")
        return tuple(value)

    def labels(self, key: str, default: Any = _MISSING) -> Any:
        """A table of string values, such as labels."""
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, dict):
            self.fail(key, f"must be a table of strings, not {type_name(value)}")
        for k, v in value.items():
            if not isinstance(v, str):
                self.fail(f"{key}.{k}", f"must be a string, not {type_name(v)}")
        return dict(value)

    def table(self, key: str, *, required: bool = False) -> Table:
        value = self._get(key, _MISSING if required else {})
        if not isinstance(value, dict):
            self.fail(key, f"must be a table, not {type_name(value)}")
        return Table(value, self._file, self._key_path(key), base_dir=self._base_dir)

    def tables(self, key: str) -> Iterator[Table]:
        """An array of tables (`[[key]]`); each is yielded with its index in the path."""
        value = self._get(key, [])
        if not isinstance(value, list):
            self.fail(key, f"must be an array of tables ([[{key}]]), not {type_name(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                self.fail(f"{key}[{i}]", f"must be a table, not {type_name(item)}")
            yield Table(item, self._file, f"{self._key_path(key)}[{i}]", base_dir=self._base_dir)

    @property
    def file(self) -> str:
        return self._file

    @property
    def data(self) -> Mapping[str, Any]:
        """The table as the file has it."""
        return self._data

    def known(self, *keys: str) -> None:
        """Count `keys` as read though absent: a misspelling of one gets its "did you mean"."""
        self._read.update(keys)

    def finish(self) -> None:
        """Reject keys nobody read: a typo must not pass silently."""
        unknown = sorted(set(self._data) - self._read)
        if unknown:
            self.fail(unknown[0], "is not a known key" + did_you_mean(unknown[0], self._read))


def did_you_mean(key: str, known: Iterable[str]) -> str:
    close = closest(key, known)
    return f" (did you mean {close!r}?)" if close is not None else ""


def closest(word: str, known: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The one of `known` that `word` is likely a misspelling of, or None: the rule for
    every "did you mean", of a config key and of a request's model or path alike."""
    import difflib  # only on the way to an error

    close = difflib.get_close_matches(word, sorted(known), n=1, cutoff=cutoff)
    return close[0] if close else None
