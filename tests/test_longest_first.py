"""The order make test hands tests to its workers (tests/longest_first.py)."""

from __future__ import annotations

from longest_first import SECONDS, UNLISTED_S, longest_first, seconds

SLOW = next(iter(SECONDS))


def test_longest_units_first_groups_together_ties_in_collection_order() -> None:
    items = [
        ("tests/test_a.py::one", None),
        ("tests/test_g.py::x", "g"),
        ("tests/test_b.py::two", None),
        (SLOW + "[p]", None),
        ("tests/test_g.py::y", "g"),
    ]
    ordered = longest_first(items, lambda item: item[0], lambda item: item[1])
    assert [name for name, _ in ordered] == [
        SLOW + "[p]",  # listed: its parameters share its figure
        "tests/test_g.py::x",  # a group counts as its sum (2 s), its tests together
        "tests/test_g.py::y",
        "tests/test_a.py::one",  # 1 s each, in collection order
        "tests/test_b.py::two",
    ]
    assert seconds("tests/test_a.py::one") == UNLISTED_S
