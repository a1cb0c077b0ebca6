"""A count of what the core looks at, kept where it looks: tests hold the work of each
event to what the event changed (counted, not timed, so that the figure does not depend
on the machine or on what else runs)."""

from __future__ import annotations

import attrs


@attrs.define
class Work:
    nodes: int = 0  # nodes visited: deadlines come, capacity built, fit checked
    replicas: int = 0  # replicas judged (classified, kept or retired)
    shards: int = 0  # shard records read outside their own replica's judgement

    def total(self) -> int:
        return self.nodes + self.replicas + self.shards
