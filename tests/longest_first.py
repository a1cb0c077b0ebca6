"""The order `make test` hands tests to its workers: the long ones early, spread.

pytest-xdist (`--dist loadgroup`) gives each idle worker the next unit of work in
collection order: a test, or a whole `xdist_group` (the tests of a module that share
a costly fixture). With the long units early, the short ones fill the gaps at the end;
in file order, a 40-second test drawn last kept one worker busy while the others had
finished (the whole run took 6 min 18 s with 169% of the 2 cores).

The seconds below are wall times (setup and call) measured on a 2-core machine with three
workers (`pytest -n 3 --durations=0`, December 2026); a test not listed counts as 1 s. They only order the
run: a stale figure costs speed, never a result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

SECONDS: dict[str, float] = {
    # Real vLLM: each start takes about a minute of a core (three in the managed test).
    "tests/test_real_vllm_managed.py::test_a_managed_vllm": 190,
    "tests/test_ha_e2e.py::test_etcd_away_for_30_s_then_back": 47,
    "tests/test_route_feed.py::test_typed_garbage_decodes_or_raises_feed_error": 39,
    "tests/test_tls_admission_storm.py::test_admin_requests_are_answered_while_300_stalled_hellos_from_8_addresses_redial": 31,
    "tests/test_real_vllm.py::test_chat_and_completions_plain_and_streamed_with_usage_and_token_counts_logged": 29,
    "tests/test_real_vllm.py::test_a_responses_chain_stays_on_the_replica_that_stored_it": 28,
    "tests/test_form_parsing.py::test_a_fuzzed_form_is_refused_or_read_as_the_engine_reads_it": 27,
    "tests/test_real_engines.py::test_llama_server_streams_idle_pauses_and_501": 25,
    "tests/test_autoscaling_e2e.py::test_a_model_scales_up_down_to_zero_and_wakes_without_a_failed_request": 24,
    "tests/test_follower.py::test_a_separate_router_with_workers_follows_keeps_sessions_reloads_and_loses_nothing_in_a_drain": 23,
    "tests/test_silence.py::test_a_black_holed_agent_stream_is_back_within_30_s_with_the_default_timers": 21,
    "tests/test_follower.py::test_a_separate_router_follows_keeps_serving_without_the_control_plane_and_catches_up": 21,
    "tests/test_ui.py::test_the_page_shows_each_models_traffic_and_a_replica_answering_500s_stands_out": 20,
    "tests/test_rolling.py::test_a_profile_change_rolls_one_replica_at_a_time_and_loses_no_request": 20,
    "tests/test_cache_aware_router.py::test_two_router_processes_agree_without_sharing_anything": 19,
    "tests/test_fleet_e2e.py::test_a_drain_moves_replicas_before_it_stops_them_and_loses_no_request": 17,
    "tests/test_readme.py::test_the_quick_start_client_and_the_first_block_run_against_the_demo": 16,
    "tests/test_faults.py::test_server_killed_mid_stream_the_client_sees_an_error_and_engines_are_adopted": 16,
    "tests/control/test_fit.py::test_the_explanation_adds_up_to_the_fleet_and_agrees_with_placement": 15,
    "tests/test_workers.py::test_with_workers_a_drain_moves_replicas_and_a_request_loop_sees_no_error": 14,
    "tests/test_demo.py::test_demo_banner_is_the_control_planes_placement_and_it_cleans_up": 14,
    "tests/control/test_control_machine.py::TestControlMachine::runTest": 14,
    "tests/test_ui.py::test_the_page_shows_every_node_replica_and_model_of_the_demo_live": 13,
    "tests/test_ui.py::test_the_page_charts_an_autoscaled_models_last_hour_live": 13,
    "tests/test_install.py::test_the_wheel_declares_the_entry_points_and_python": 13,
    "tests/test_real_vllm.py::test_idle_pauses_across_vllms_keep_alive_fail_nothing": 12,
    "tests/test_faults.py::test_stragglers_back_within_lost_after_of_the_guards_release_keep_their_replicas": 12,
    "tests/test_router_follows_leader.py::test_a_stale_leaders_table_is_refused_and_the_router_keeps_serving_its_own": 11,
    "tests/test_real_engines.py::test_uvicorn_closing_idle_connections_fails_nothing": 11,
    "tests/test_fuzz_http.py::test_chunked_bodies_cut_short_get_an_answer_or_a_close": 11,
    "tests/test_faults.py::test_a_lost_node_that_comes_back_has_its_old_shard_drained_and_stopped": 11,
    "tests/test_ha_e2e.py::test_a_leader_paused_past_its_lease_wakes_and_does_not_act": 10,
    "tests/test_demo.py::test_demo_keeps_its_directory_on_request_and_its_configs_check": 10,
    "tests/test_ui_held.py::test_the_page_shows_the_requests_held_while_a_model_wakes": 9,
    "tests/test_stream_keepalive.py::test_a_healthy_stream_is_kept_alive_by_heartbeats_and_their_acks_alone": 9,
    "tests/test_llamacpp_managed.py::test_a_managed_llama_server": 9,
    "tests/test_fuzz_http.py::test_wrong_content_length_gets_an_answer_or_a_close": 9,
    "tests/test_fleet_e2e.py::test_a_drain_stops_a_replica_still_streaming_once_drain_timeout_s_has_passed": 9,
    "tests/test_election.py::test_etcd_stopped_the_leader_steps_down_by_its_deadline_and_back_one_leads": 9,
    "tests/control/test_hello_answer.py::test_hello_answers::runTest": 9,
    "tests/test_real_vllm.py::test_the_tiny_model_and_its_adapter_are_made_the_same_twice": 8,
    "tests/test_fuzz_config.py::test_arbitrary_server_tables_load_or_raise_config_error": 8,
    "tests/test_fuzz_agents.py::test_garbage_closes_the_offender_only": 8,
    "tests/test_etcd_client.py::test_failover_when_the_member_in_use_dies": 8,
    "tests/test_election.py::test_one_etcd_member_lost_changes_no_leadership": 8,
    "tests/test_ui.py::test_the_page_follows_the_fleet_live_in_headless_chromium": 7,
    "tests/test_real_vllm.py::test_precise_predicts_vllms_cached_tokens_request_by_request": 7,
    "tests/test_leadership_machine.py::TestElectionMachine::runTest": 7,
    "tests/test_ha_e2e.py::test_the_leader_sigkilled_another_leads_and_no_request_fails": 7,
    "tests/test_ha_e2e.py::test_every_control_plane_restarted_one_at_a_time": 7,
    "tests/test_reconnect_storm.py::test_200_agents_come_back_spread_by_jitter_and_are_all_admitted": 6,
    "tests/test_mock_engine.py::test_a_full_engine_queues_first_come_first_served": 6,
    "tests/test_ha_e2e.py::test_a_sigtermed_leader_hands_over_at_once": 6,
    "tests/test_ha_e2e.py::test_a_model_at_zero_woken_during_a_failover_serves_its_held_request": 6,
    "tests/test_fleet_e2e.py::test_a_killed_agent_goes_unreachable_then_lost_and_the_explanation_says_why": 6,
    "tests/test_agent_stream.py::test_mutual_tls_binds_the_node_name_to_its_certificate": 6,
    "tests/test_silence.py::test_the_agent_cuts_a_black_holed_stream_and_redials_without_the_backoff_cap": 5,
    "tests/test_restart_e2e.py::test_a_restart_fails_no_request_and_delays_none_past_the_bound": 5,
    "tests/test_lost_leader_flood.py::test_floods_from_many_addresses_spend_the_budget_and_no_more_and_an_agent_registers": 5,
    "tests/test_admin_auth.py::test_a_token_is_required_for_status_and_actions": 5,
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
