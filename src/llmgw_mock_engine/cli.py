"""The mock engine's command line (`python -m llmgw_mock_engine`, `llmgw-mock-engine`).

`--version` is answered before the engine's modules load: every agent asks each of its
engines' programs for its version when it starts, and the engine's imports (trio, the
HTTP server) cost about 0.3 s of CPU where the answer alone costs 0.02 s.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def cli(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if list(argv) == ["--version"]:
        from llmgw_core import __version__

        print(f"llmgw-mock-engine {__version__}")
        return
    from llmgw_mock_engine.engine import serve

    serve(argv)
