"""How much of the event loop's time one background feed may take (router.kv_feed).

A token bucket of seconds (llmgw_core.token_bucket): a feed may spend `rate` of each
second on the loop, and up to `burst` at once after it was idle. The shell times each
slice of work it runs (a synchronous piece between two checkpoints) and reports it with
`spent`; before the next slice it waits `wait` seconds, so that an engine sending more
than its share is read at its share and no faster: the rest waits in a bounded queue,
then is dropped. Pure: the shell supplies the times.
"""

from __future__ import annotations

import attrs

from llmgw_core.token_bucket import TokenBucket


@attrs.define
class LoopShare(TokenBucket):
    """A bucket of seconds of the loop: `rate` is the share of each second (0 to 1),
    `burst` what may be spent at once after idling."""

    def __attrs_post_init__(self) -> None:
        if not 0 < self.rate <= 1 or self.burst <= 0:
            raise ValueError(f"a loop share is in (0, 1] with a positive burst: {self}")
