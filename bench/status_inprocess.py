"""The admin status in one process, side by side with another tree's: the view, the
documents, their data and `json.dumps`, for a fleet of N nodes of 8 GPUs made with the
control core's own simulator (tests/control/fleetsim.py), under the server's GC settings.

    python bench/status_inprocess.py ROOT before|after N

ROOT holds `src` and `tests` (`git archive ec0ac25 src tests` for the status before the
redesign: "before" calls its `plane.admin.status`); run both alternately and compare
the medians it prints (docs/performance.md, the redesign).
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def main() -> None:
    root, side, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sys.path[:0] = [f"{root}/tests", f"{root}/tests/control", f"{root}/src"]
    from fleetsim import FAST, Fleet, catalog, gpu_node, model

    f = Fleet(FAST, catalog(model("m", 2)), now=1000.0)
    for i in range(n):
        f.join(gpu_node(f"n{i:05d}", 8))
    f.advance(30)
    f.ready_all()
    whole: Callable[[], str]
    page: Callable[[], str]
    if side == "before":
        from llmgw_server.plane.admin import status, status_page  # type: ignore

        class Plane:
            output_tails: dict[Any, Any] = {}

        def whole() -> str:
            return json.dumps(status(f.cp.view(), Plane(), f.now), separators=(",", ":"))

        def page() -> str:
            view, pg = status_page(f.cp.view(), {"limit": ["100"]})
            data = status(view, Plane(), f.now)
            data["page"] = pg
            return json.dumps(data, separators=(",", ":"))
    else:
        import attrs

        from llmgw_server.control.documents import to_json
        from llmgw_server.control_shell.admin import NodeParts, status_doc, status_page

        kept = NodeParts()

        def whole() -> str:
            return json.dumps(to_json(status_doc(f.cp.view(), {}, f.now, kept)), separators=(",", ":"))

        def page() -> str:
            names, pg = status_page(f.cp.node_names(), {"limit": ["100"]})
            assert pg is not None
            doc = attrs.evolve(status_doc(f.cp.view(names), {}, f.now, kept, pg.of), page=pg)
            return json.dumps(to_json(doc), separators=(",", ":"))

    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 10)  # as the server has them
    for fn in (whole, page):
        fn()
        times = []
        for _ in range(25):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        print(side, n, fn.__name__, f"{statistics.median(times) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
