"""The flags an engine program takes, read from its own help text, and a launch checked
against them before it starts.

An engine refuses a flag it does not know only after its imports (vLLM: a minute of
CPU) and exits; a profile written for another version, or with a typo, would crash-loop.
The installed program's own help says which flags it takes: vLLM `serve --help=all`
(argparse's help, options indented two spaces), llama-server `--help` (its own format,
options at the start of the line). Both list each option's spellings separated by
commas before its metavar, and the help text after a gap of two or more spaces or on
the next lines, indented further. Pure: the agent's shell (`flag_reader`) runs the
program and caches what it printed.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence

from llmgw_core.engines import flag_name

# The line that introduces an option: at most two spaces in (help text is indented
# further), a dash and a letter (`-1` is a value, `-----` a section title).
_OPTION_LINE = re.compile(r"^ {0,2}(-{1,2}[A-Za-z].*)$")
# The options' spellings end where the help text begins: a gap not right after a comma
# (llama-server aligns `-c,    --ctx-size`).
_HELP_GAP = re.compile(r"(?<=[^,\s])\s{2,}")
# A spelling: at the start, or after a comma (a metavar such as `{a,b}` has no dash).
_SPELLING = re.compile(r"(?:^|,\s*)(-{1,2}[A-Za-z][\w.-]*)")
# What an argument must look like to be an option, as argparse decides it: a dash and a
# letter (`-1`, `-0.5` are values).
_IS_FLAG = re.compile(r"^-{1,2}[A-Za-z]")


def parse_help(text: str) -> frozenset[str]:
    """Every option spelling the help text lists (`--max-model-len`, `-tp`, `--no-x`)."""
    found: set[str] = set()
    for line in text.splitlines():
        option = _OPTION_LINE.match(line)
        if option is None:
            continue
        spellings = _HELP_GAP.split(option.group(1), maxsplit=1)[0]
        found.update(m.group(1) for m in _SPELLING.finditer(spellings))
    return frozenset(found)


def help_command(engine: str, command: Sequence[str]) -> list[str] | None:
    """How to ask an engine's program for its flags; None for one not checked: the mock
    engine takes any flag (it stands in for vLLM and ignores what it does not model)."""
    if engine in ("vllm",):
        return [*command, "serve", "--help=all"]  # plain --help lists the groups only
    if engine in ("llamacpp", "sglang"):
        return [*command, "--help"]
    return None


def unknown(engine: str, known: frozenset[str], argv: Sequence[str]) -> list[str]:
    """The arguments of `argv` that name an option the program does not list, in order.

    Stricter than argparse in one way: an abbreviation argparse would expand
    (`--max-model`) is refused, since a later version's new flag can make it ambiguous."""
    return [a for a in argv if _IS_FLAG.match(a) and flag_name(engine, a) not in known]


def refusals(
    engine: str,
    program: str,
    known: frozenset[str],
    own: Sequence[str],
    args: Sequence[str],
) -> list[str]:
    """Why a launch cannot start: the profile's `args`, then llmgw's `own` arguments (the
    adapter's), naming options the program's help does not list."""
    found = [
        f"the profile's args name {arg}, which {program} does not take{_close(engine, known, arg)}"
        for arg in unknown(engine, known, args)
    ]
    theirs = unknown(engine, known, own)
    if theirs:
        found.append(
            f"{program} does not take {', '.join(theirs)}, which llmgw passes it: "
            "this engine version is not one the agent knows"
        )
    return found


def _close(engine: str, known: frozenset[str], arg: str) -> str:
    close = difflib.get_close_matches(flag_name(engine, arg), known, n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""
