"""The command lines as a user meets them: each run as a process, its exit status and its
words checked, and never a traceback."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from llmgw_core.certs import init_ca, issue_node

ROOT = Path(__file__).parent.parent
SIM = ROOT / "conf" / "sim" / "node-2xl4.toml"
MODEL = '[[models]]\nname = "chat"\n[models.profile]\nengine = "vllm"\nmodel = "org/chat"\n'


def run(
    module: str, *args: str, stdin: str | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        input=stdin,
        stdin=subprocess.DEVNULL if stdin is None else None,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=cwd,
        start_new_session=True,  # no controlling terminal: getpass cannot fall back to one
    )
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    return done


def server(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return run("llmgw_server", *args, stdin=stdin)


def agent(*args: str) -> subprocess.CompletedProcess[str]:
    return run("llmgw_agent", *args)


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


# --- the server's commands, no server needed ---------------------------------------------


def test_help_lists_every_command_certs_included() -> None:
    done = server("--help")
    assert done.returncode == 0
    for command in ("serve", "check-config", "status", "explain", "drain", "hash-key", "certs"):
        assert f"\n    {command} " in done.stdout, (command, done.stdout)


def test_certs_still_runs_after_global_options(tmp_path: Path) -> None:
    done = server("--log-level", "debug", "certs", "init", str(tmp_path / "ca"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ca" / "ca.crt").is_file()


def test_log_level_takes_only_known_levels_before_or_after_the_command() -> None:
    for module in ("llmgw_server", "llmgw_agent"):
        before = run(module, "--log-level", "verbose", "check-config", str(SIM))
        after = run(module, "check-config", str(SIM), "--log-level", "verbose")
        for done in (before, after):
            assert done.returncode == 2
            assert "argument --log-level: invalid choice: 'verbose'" in done.stderr
            assert "'debug', 'info', 'warning', 'error'" in done.stderr
    ok = server("check-config", str(ROOT / "conf" / "router.toml"), "--log-level", "WARNING")
    assert ok.returncode == 0, ok.stderr


def test_check_config_counts_its_models_in_words(tmp_path: Path) -> None:
    for count, said in ((1, "1 model"), (2, "2 models")):
        path = tmp_path / f"{count}.toml"
        path.write_text(
            "".join(
                f'[[models]]\nname = "chat{n}"\nendpoints = ["http://127.0.0.1:8001"]\n'
                for n in range(count)
            )
        )
        done = server("check-config", str(path))
        assert done.returncode == 0, done.stderr
        assert one_line(done.stdout) == f"{path}: ok, {said}"


def test_hash_key_without_a_key_is_one_clear_line() -> None:
    for stdin, args in ((None, ()), ("", ()), ("\n", ()), (None, ("",)), (None, ("  ",))):
        done = server("hash-key", *args, stdin=stdin)
        assert done.returncode == 2, (stdin, args, done)
        assert one_line(done.stderr) == (
            "llmgw-server: hash-key: no key given (pass it as an argument, on stdin, "
            "or type it at the prompt)"
        )
        assert done.stdout == ""


def test_hash_key_from_an_argument_or_stdin() -> None:
    digest = "sha256:" + hashlib.sha256(b"sk-test").hexdigest()
    assert server("hash-key", "sk-test").stdout.strip() == digest
    piped = server("hash-key", stdin="sk-test\n")
    assert piped.returncode == 0 and piped.stdout.strip() == digest
    # Global options after the command are taken too.
    assert server("hash-key", "--log-level", "error", "sk-test").stdout.strip() == digest


def test_global_options_after_the_command_reach_it(tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    done = server("status", "--config", str(missing))
    assert done.returncode == 2
    assert one_line(done.stderr) == f"llmgw-server: config error: {missing}: no such file"
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    done = server("explain", "chat", "--token-file", str(empty))
    assert done.returncode == 2 and one_line(done.stderr).endswith("is empty")
    # One given before the command is not lost to the command's defaults.
    done = server("--token-file", str(empty), "status")
    assert done.returncode == 2 and one_line(done.stderr).endswith("is empty")


# --- the agent's check-config ------------------------------------------------------------


def _agent_config(tmp_path: Path, tls: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(
        'name = "n1"\nserver = "wss://127.0.0.1:8081/v1/agent"\nstate_dir = "state"\n'
        f'inventory_file = "{SIM}"\n{tls}'
    )
    return path


def test_agent_check_config(tmp_path: Path) -> None:
    init_ca(tmp_path / "tls")
    crt, key, _ = issue_node(tmp_path / "tls", "n1")
    tls = f'[tls]\nca = "tls/ca.crt"\ncert = "{crt.relative_to(tmp_path)}"\nkey = "{key.relative_to(tmp_path)}"\n'
    good = _agent_config(tmp_path, tls)
    done = agent("check-config", str(good))
    assert done.returncode == 0, done.stderr
    assert one_line(done.stdout).startswith(
        f"{good}: ok, node n1, server wss://127.0.0.1:8081/v1/agent, GPUs 2 simulated, engines "
    )
    assert agent("--log-level", "debug", "check-config", str(good)).returncode == 0
    assert not (tmp_path / "state").exists()  # validating creates nothing

    # A key that is not the certificate's: the agent could never connect.
    _, other_key, _ = issue_node(tmp_path / "tls", "n2")
    mismatched = _agent_config(
        tmp_path, f'[tls]\nca = "tls/ca.crt"\ncert = "{crt}"\nkey = "{other_key}"\n'
    )
    done = agent("check-config", str(mismatched))
    assert done.returncode == 2
    assert one_line(done.stderr).startswith(f"llmgw-agent: config error: {mismatched}: [tls]")

    no_tls = _agent_config(tmp_path, "")
    done = agent("check-config", str(no_tls))
    assert done.returncode == 2
    assert "is required for a wss:// server" in one_line(done.stderr)

    done = agent("check-config", str(tmp_path / "absent.toml"))
    assert done.returncode == 2
    assert (
        one_line(done.stderr)
        == f"llmgw-agent: config error: {tmp_path / 'absent.toml'}: no such file"
    )


def test_agent_probe_reads_the_configs_inventory_file_and_check_config_takes_config(tmp_path: Path) -> None:
    init_ca(tmp_path / "tls")
    crt, key, _ = issue_node(tmp_path / "tls", "n1")
    config = _agent_config(tmp_path, f'[tls]\nca = "tls/ca.crt"\ncert = "{crt}"\nkey = "{key}"\n')
    probed = agent("--config", str(config), "probe")
    assert probed.returncode == 0, probed.stderr
    assert probed.stdout == agent("probe", "--from", str(SIM)).stdout
    assert 'uuid = "GPU-sim-l4-1"' in probed.stdout  # the simulated node's, not NVML's
    checked = agent("check-config", "--config", str(config))
    assert checked.returncode == 0 and one_line(checked.stdout).startswith(f"{config}: ok, node n1")
    neither = agent("check-config")
    assert neither.returncode == 2 and "check-config needs a config file" in neither.stderr


def _described(help_text: str) -> list[str]:
    """The options and arguments a --help lists without a word on what they are."""
    lines = help_text.splitlines()
    bare = []
    for i, line in enumerate(lines):
        entry = line.strip()
        starts_entry = line.startswith("  ") and not line.startswith("      ") and entry
        if not starts_entry or entry.endswith(":"):
            continue
        parts = entry.split("  ", 1)
        if not parts[0].startswith(("-", "{")) and " " in parts[0]:
            continue  # a group's description, not an option
        described = len(parts) == 2 and parts[1].strip()
        continued = i + 1 < len(lines) and lines[i + 1].startswith(" " * 8) and lines[i + 1].strip()
        if not described and not continued:
            bare.append(entry)
    return bare


def test_help_describes_each_option_and_lists_only_those_that_apply() -> None:
    mock = run("llmgw_mock_engine", "--help")
    assert mock.returncode == 0 and "--mock-fail-status" in mock.stdout
    assert _described(mock.stdout) == [], mock.stdout
    for argv in (["certs", "init", "--help"], ["certs", "issue", "--help"]):
        done = server(*argv)
        assert done.returncode == 0 and _described(done.stdout) == [], done.stdout
    hash_key = server("hash-key", "--help")
    for unrelated in ("--control", "--ca", "--token-file"):
        assert unrelated not in hash_key.stdout, hash_key.stdout
    status = server("status", "--help")
    assert "--control" in status.stdout and "--token-file" in status.stdout


# --- against a real control plane ----------------------------------------------------------


def _cli(fleet: Any, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "llmgw_server", *args],
        capture_output=True,
        text=True,
        timeout=20,
        stdin=subprocess.DEVNULL,
    )
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    return done


def test_options_after_the_command_json_and_the_start_up_line(fleet: Any) -> None:
    fleet.server(MODEL)
    config = str(fleet.procs.tmp / "server.toml")
    # --config after the command: the control URL (https) and the CA come from it.
    table = _cli(fleet, "status", "--config", config)
    assert table.returncode == 0, table.stderr
    assert "MODEL" in table.stdout and "chat" in table.stdout
    as_json = _cli(fleet, "status", "--json", "--config", config)
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert [m["name"] for m in data["models"]] == ["chat"]
    assert data["nodes"] == [] and data["replicas"] == []  # no agent in this fleet
    explain = _cli(
        fleet, "explain", "chat", "--control", fleet.control, "--ca", str(fleet.certs / "ca.crt")
    )
    assert explain.returncode == 0, explain.stderr
    # The agent stream is TLS, and the start-up line says so.
    line = f"agents: wss://127.0.0.1:{fleet.control_port}/v1/agent"
    assert line in fleet.server_proc.output()
    assert "agents: ws://" not in fleet.server_proc.output()


def test_wrong_scheme_or_untrusted_certificate_says_what_to_do(fleet: Any) -> None:
    fleet.server(MODEL)
    plain = _cli(fleet, "--control", f"http://127.0.0.1:{fleet.control_port}", "explain", "chat")
    assert plain.returncode == 1
    assert one_line(plain.stderr).endswith(
        f"(the control port speaks https: use --control https://127.0.0.1:{fleet.control_port} "
        "with --ca FILE, the fleet's CA, or --config with the server's config)"
    )
    untrusted = _cli(fleet, "--control", fleet.control, "status")
    assert untrusted.returncode == 1
    assert "the control plane's certificate is not trusted: give --ca FILE" in one_line(
        untrusted.stderr
    )
    # The router's port speaks plain HTTP: https to it says so.
    router = _cli(fleet, "--control", f"https://127.0.0.1:{fleet.port}", "status")
    assert router.returncode == 1
    assert "that port does not speak https" in one_line(router.stderr)


def test_status_names_a_crash_loop_and_its_reason(fleet: Any) -> None:
    from fleet import wait_until

    fleet.server(MODEL, control="crash_loop_after = 2")
    fleet.agent("gpu-1", "node-2xl4.toml", env='LLMGW_MOCK_EXIT_AFTER = "0.2"')

    def looping() -> dict[str, Any] | None:
        replicas = fleet.status()["replicas"]
        return next((r for r in replicas if r["crash_loop"] and r["reason"]), None)

    replica = wait_until(looping, timeout=30, what="a crash-looping replica")

    # The replica's reason follows its phase: "restarting (N failures)" while it starts
    # again, the engine's exit while it waits for its restart. Which one a `status` call
    # meets is the scheduler's choice: wait for the line that names the exit.
    exited = f"{replica['replica_id']} crash loop: the engine exited with status 3 ("

    def models_line() -> str | None:
        done = fleet.cli("status")
        assert done.returncode == 0, done.stderr
        line = next(x for x in done.stdout.splitlines() if x.startswith("chat "))
        return line if exited in line else None

    line = wait_until(models_line, timeout=30, what="the crash loop and its exit in the models table")
    name, desired, placed, serving, autoscaling, why = line.split(None, 5)
    assert (name, desired, placed, serving, autoscaling) == ("chat", "1", "1", "0", "-")
    assert why.startswith(exited)
    assert " failures" in why


def test_a_port_in_use_is_one_line_for_the_router_and_the_control_port(tmp_path: Path) -> None:
    """Exit 1 and one line, no traceback (`run` checks), whichever port is taken."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        with socket.socket() as spare:
            spare.bind(("127.0.0.1", 0))
            free = spare.getsockname()[1]
        for listen, control, what in (
            (busy, free, f"cannot listen on 127.0.0.1:{busy}: "),
            (free, busy, f"cannot listen on 127.0.0.1:{busy} (control_listen): "),
        ):
            config = tmp_path / "server.toml"
            config.write_text(
                f'[server]\nlisten = "127.0.0.1:{listen}"\ncontrol_listen = "127.0.0.1:{control}"\n'
                f"[agents]\ninsecure = true\n{MODEL}"
            )
            done = server("--config", str(config))
            assert done.returncode == 1
            line = done.stderr.strip().splitlines()[-1]  # after the config's warnings
            assert line.startswith(f"llmgw-server: {what}") and "in use" in line, line
