"""One replica of a model, as this router sees it.

Who writes what (nobody else writes a field):
- the balancer (balancer.py): `outstanding` (`sent`, `finished`), `failures`, `ejected`,
  `probe_after` (`failed`, `succeeded`, `probed`), `healthy` (`probed`, after each health
  probe), `draining` (`mark_draining`, from the route table), `busy_until` (`busy`);
- the engine-load reader (health.py): `engine_load`, `engine_load_at` and
  `outstanding_at_load`, together, through `took_reading`;
- `rid` once, at creation.
What a balancing policy remembers about a replica (cache_aware's prefix index and recent
share) is the policy's own state, kept in the policy (see policies/).
"""

from __future__ import annotations

import attrs

from llmgw_core.catalog import Endpoint
from llmgw_server.router.load_signals import LoadSignal
from llmgw_server.router.prefix import stable_hash


@attrs.define(eq=False, slots=True)
class Replica:
    endpoint: Endpoint
    outstanding: int = 0  # this router's requests sent to it and not finished
    healthy: bool = True  # what the last health probe said
    ejected: bool = False  # too many consecutive failures; waits for a good probe
    probe_after: float = 0.0  # when an ejected replica may be probed again
    failures: int = 0  # consecutive
    draining: bool = False  # takes no new requests; those in flight finish
    lost: bool = False  # gone from the route table without draining: its streams were cut
    busy_until: float = 0.0  # it answered 429/503 with Retry-After: others go first until then
    engine_load: LoadSignal | None = None  # the engine's last reading of its own load
    engine_load_at: float = 0.0  # when it was read
    outstanding_at_load: int = 0  # this router's outstanding requests when it was read
    rid: int = attrs.field(init=False)  # its name in rendezvous hashing, the same everywhere

    def __attrs_post_init__(self) -> None:
        self.rid = stable_hash(self.endpoint.url)

    @property
    def available(self) -> bool:
        return self.healthy and not self.ejected and not self.draining

    def took_reading(self, signal: LoadSignal, now: float) -> None:
        """The engine's own reading of its load, read at `now` (the load reader's write):
        kept with this router's count at that moment, which the reading already holds."""
        self.engine_load = signal
        self.engine_load_at = now
        self.outstanding_at_load = self.outstanding
