"""The order make test hands tests to its workers (tests/longest_first.py)."""

from __future__ import annotations

from longest_first import SECONDS, UNLISTED_S, longest_first, seconds

SLOW, LONGER_THAN_GROUP = list(SECONDS)[:2]
SECOND = (LONGER_THAN_GROUP, None)


def test_long_units_spread_over_the_first_half_longest_first_groups_together() -> None:
    shorts = [(f"tests/test_s.py::t{i}", None) for i in range(12)]
    group = [(f"tests/test_g.py::x{i}", "g") for i in range(6)]  # 6 x 1 s: one long unit
    items = [shorts[0], *group[:3], SECOND, *shorts[1:5], (SLOW + "[p]", None)]
    items += [*group[3:], *shorts[5:]]
    ordered = [name for name, _ in longest_first(items, lambda i: i[0], lambda i: i[1])]
    # Three long units, twelve short ones: two short after each long one, in the first half.
    assert ordered == [
        SLOW + "[p]",  # listed: its parameters share its figure
        *[f"tests/test_s.py::t{i}" for i in (0, 1)],
        SECOND[0],
        *[f"tests/test_s.py::t{i}" for i in (2, 3)],
        *[name for name, _ in group],  # a group counts as its sum, its tests together
        *[f"tests/test_s.py::t{i}" for i in range(4, 12)],
    ]
    assert seconds("tests/test_s.py::t0") == UNLISTED_S


def test_only_short_units_keep_their_order() -> None:
    items = [("tests/test_b.py::b", None), ("tests/test_a.py::a", None)]
    assert longest_first(items, lambda i: i[0], lambda i: i[1]) == items
