"""The order `make test` hands tests to its workers: the long ones early, spread.

pytest-xdist (`--dist loadgroup`) gives each idle worker the next unit of work in
collection order: a test, or a whole `xdist_group` (the tests of a module that share
a costly fixture). With the long units early, the short ones fill the gaps at the end;
in file order, a 40-second test drawn last kept one worker busy while the others had
finished (the whole run took 6 min 18 s with 169% of the 2 cores).

The seconds below are wall times measured on an idle 2-core machine with three workers
(`pytest -n 3 --durations=60`); a test not listed counts as 1 s. They only order the
run: a stale figure costs speed, never a result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

SECONDS: dict[str, float] = {
    # Real vLLM: each start takes about a minute of a core (four in the managed test).
    "tests/test_real_vllm_managed.py::test_a_managed_vllm": 280,
    "tests/test_real_vllm.py::test_chat_and_completions_plain_and_streamed_with_usage_and_token_counts_logged": 90,
    "tests/test_real_vllm.py::test_idle_pauses_across_vllms_keep_alive_fail_nothing": 40,
    "tests/test_real_vllm.py::test_the_router_sees_vllm_queueing_from_its_real_metrics": 30,
    "tests/test_real_vllm.py::test_the_tiny_model_and_its_adapter_are_made_the_same_twice": 30,
    "tests/control/test_control_machine.py::TestControlMachine::runTest": 44,
    "tests/test_real_engines.py::test_llama_server_streams_idle_pauses_and_501": 41,
    "tests/test_reconnect_storm.py::test_200_agents_come_back_spread_by_jitter_and_are_all_admitted": 35,
    "tests/test_follower.py::test_a_separate_router_with_workers_follows_keeps_sessions_reloads_and_loses_nothing_in_a_drain": 30,
    "tests/test_follower.py::test_a_separate_router_follows_keeps_serving_without_the_control_plane_and_catches_up": 29,
    "tests/test_silence.py::test_a_black_holed_agent_stream_is_back_within_30_s_with_the_default_timers": 25,
    "tests/test_llamacpp_managed.py::test_a_managed_llama_server": 22,
    "tests/test_workers.py::test_with_workers_a_drain_moves_replicas_and_a_request_loop_sees_no_error": 20,
    "tests/test_fleet_e2e.py::test_a_drain_moves_replicas_before_it_stops_them_and_loses_no_request": 19,
    "tests/test_faults.py::test_server_killed_mid_stream_the_client_sees_an_error_and_engines_are_adopted": 17,
    "tests/test_cache_aware_router.py::test_two_router_processes_agree_without_sharing_anything": 16,
    "tests/test_rolling.py::test_a_profile_change_rolls_one_replica_at_a_time_and_loses_no_request": 16,
    "tests/test_faults.py::test_stragglers_back_within_lost_after_of_the_guards_release_keep_their_replicas": 15,
    "tests/test_route_feed.py::test_typed_garbage_decodes_or_raises_feed_error": 15,
    "tests/control/test_fit.py::test_the_explanation_adds_up_to_the_fleet_and_agrees_with_placement": 14,
    "tests/test_faults.py::test_a_lost_node_that_comes_back_has_its_old_shard_drained_and_stopped": 14,
    "tests/test_ui.py::test_the_page_follows_the_fleet_live_in_headless_chromium": 13,
    "tests/test_real_engines.py::test_uvicorn_closing_idle_connections_fails_nothing": 13,
    "tests/test_readme.py::test_the_quick_start_client_runs_as_written_against_the_demo": 13,
    "tests/test_demo.py::test_demo_banner_is_the_control_planes_placement_and_it_cleans_up": 12,
    "tests/test_admin_auth.py::test_cli_takes_the_token_from_the_environment_or_a_file": 12,
    "tests/test_ui.py::test_the_page_shows_every_node_replica_and_model_of_the_demo_live": 11,
    "tests/test_faults.py::test_a_restarted_agent_adopts_its_running_engines_and_reports_dead_ones": 11,
    "tests/test_fleet_e2e.py::test_a_killed_agent_goes_unreachable_then_lost_and_the_explanation_says_why": 11,
    "tests/test_adoption_e2e.py::test_a_restarted_agent_adopts_two_engines_across_a_control_plane_restart": 8,
    "tests/test_workers.py::test_with_a_control_plane_both_workers_follow_the_replicas_and_sessions_keep_theirs": 8,
    "tests/test_adoption_e2e.py::test_what_is_left_of_an_engine_that_cannot_be_adopted_is_stopped_before_its_replacement": 8,
    "tests/test_cache_aware.py::test_two_routers_that_each_saw_half_the_traffic_agree": 8,
    "tests/test_router_apart.py::test_a_router_apart_is_ready_only_once_its_control_plane_sent_a_table": 6,
    "tests/test_wire.py::test_arbitrary_json_with_a_real_tag_decodes_or_raises_wire_error": 7,
    "tests/test_faults.py::test_a_partitioned_node_turns_unreachable_and_is_not_lost_when_it_comes_back": 7,
    "tests/test_fleet_e2e.py::test_a_drain_that_would_take_a_model_offline_is_refused_unless_forced": 7,
    "tests/test_reload.py::test_sighup_reloads_keys_and_static_models_without_dropping_a_stream": 5,
    "tests/test_cli.py::test_wrong_scheme_or_untrusted_certificate_says_what_to_do": 7,
    "tests/test_agent_stream.py::test_mutual_tls_binds_the_node_name_to_its_certificate": 7,
    "tests/test_router.py::test_graceful_shutdown_finishes_the_request_in_flight": 7,
    "tests/test_workers.py::test_sigterm_drains_every_worker_then_leaves_no_process": 6,
}
UNLISTED_S = 1.0
LONG_S = 5.0


def seconds(nodeid: str) -> float:
    """A test's expected wall time: its parameters share one figure."""
    return SECONDS.get(nodeid.split("[", 1)[0], UNLISTED_S)


def longest_first(items: Sequence[T], nodeid: Callable[[T], str], group: Callable[[T], str | None]) -> list[T]:
    """`items` with the long units (LONG_S or more) spread over the first half of the
    run, longest first, between the short ones; a group's tests stay together, in their
    order, and count as their sum. Short units keep their collection order.

    Spread, not all first: most long tests are long because they wait (for a timer, a
    process, an idle pause), and three of them at once left the cores half idle at the
    start of a run, while the short ones beside them keep the cores busy."""
    units: dict[str, list[T]] = {}
    for item in items:
        key = group(item)
        units.setdefault(nodeid(item) if key is None else f"group:{key}", []).append(item)
    total = {key: sum(seconds(nodeid(item)) for item in members) for key, members in units.items()}
    long = sorted((key for key in units if total[key] >= LONG_S), key=lambda key: -total[key])
    short = [key for key in units if total[key] < LONG_S]
    between = len(short) // (2 * len(long)) if long else 0
    ordered: list[str] = []
    for i, key in enumerate(long):
        ordered += [key, *short[i * between : (i + 1) * between]]
    ordered += short[len(long) * between :]
    return [item for key in ordered for item in units[key]]
