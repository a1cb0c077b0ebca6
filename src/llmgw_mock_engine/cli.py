"""The mock engine's command line (`python -m llmgw_mock_engine`, `llmgw-mock-engine`).

`--version` is answered before the engine's modules load: every agent asks each of its
engines' programs for its version when it starts, and the engine's imports (trio, the
HTTP server) cost about 0.3 s of CPU where the answer alone costs 0.02 s. So is help
(`serve --help=all`, which every agent asks before its first launch), by the parser
alone (llmgw_mock_engine.options).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def cli(argv: Sequence[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if args == ["--version"]:
        from llmgw_core import __version__

        print(f"llmgw-mock-engine {__version__}")
        return
    import os

    from llmgw_mock_engine.options import as_serve, build_parser, is_help

    if is_help(args):  # argparse answers and exits, before the engine's imports
        build_parser(os.environ).parse_known_args(as_serve(args))
    from llmgw_mock_engine.engine import serve

    serve(args)
