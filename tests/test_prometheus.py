"""The Prometheus text helpers every /metrics page is written with (llmgw_core.prometheus)."""

from __future__ import annotations

from llmgw_core.prometheus import Histogram, escape, family, labels


def test_label_values_are_escaped_and_kept_in_order() -> None:
    assert escape('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    assert labels(model='m"1', endpoint="http://e:1") == '{model="m\\"1",endpoint="http://e:1"}'
    assert labels() == "{}"


def test_a_family_is_its_help_then_its_type() -> None:
    assert family("x_total", "counter", "Things.") == (
        "# HELP x_total Things.",
        "# TYPE x_total counter",
    )


def test_a_histogram_renders_cumulative_buckets_then_sum_and_count() -> None:
    h = Histogram((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 9.0):
        h.observe(value)
    assert list(h.render("d_seconds", labels(model="m"))) == [
        'd_seconds_bucket{model="m",le="1.0"} 2',
        'd_seconds_bucket{model="m",le="2.0"} 3',
        'd_seconds_bucket{model="m",le="+Inf"} 4',
        'd_seconds_sum{model="m"} 12.000000',
        'd_seconds_count{model="m"} 4',
    ]
    assert next(iter(Histogram((1.0,)).render("e", "{}"))) == 'e_bucket{le="1.0"} 0'
