"""A balancing policy is one file (issue 37): a module that declares `POLICY` in the
llmgw_server.router.policies package is found (pkgutil over the package's `__path__`),
and everything else serves it: `[router] balancing` names it, `check-config` reads its
section with the config's converter, the router routes by it and counts its decisions
on /metrics, with its own families there.

The module is written into a temporary directory added to the package's `__path__`
(where a module of the package is looked for): nothing else is written, and no other
file of the project knows its name. The router runs in this process (its module is on
this process's path alone), in front of two mock engines.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from llmgw_core.config import Config, load_config
from llmgw_http.server import HTTPServer, ServerLimits
from llmgw_server import __main__ as cli
from llmgw_server.reload import Reloader, ReloadPlan
from llmgw_server.router import policies
from llmgw_server.router.front import Router
from llmgw_server.router.policies import PolicyBook, registered
from procs import Procs, metric, models_toml

NAME = "pick_by_index"

MODULE = '''
"""`balancing = "pick_by_index"`: the replica at `[router.pick_by_index] index`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import attrs

from llmgw_core.config_schema import rules
from llmgw_core.prometheus import family, labels
from llmgw_server.router.policies.policy import (
    Choice, Decision, Given, Needs, Oblivious, Policy, PolicySpec,
)

PICKED = Decision("picked_by_index", "the replica at the configured index")


@attrs.frozen
class PickSection:
    index: int = attrs.field(default=0, metadata=rules(min=0))


class PickByIndex(Oblivious):
    def __init__(self, section: PickSection, picks: Counter[str]) -> None:
        self.index = section.index
        self.picks = picks

    def choose(self, candidates, prompt, now):
        chosen = candidates[min(self.index, len(candidates) - 1)]
        self.picks[chosen.endpoint.url] += 1
        return Choice(chosen, PICKED)


def picks_page(picks: Counter[str], urls: Sequence[str]) -> list[str]:
    out = [*family("llmgw_pick_by_index_picks_total", "counter", "Picks, by engine.")]
    for url in sorted(set(urls)):
        out.append(f"llmgw_pick_by_index_picks_total{labels(endpoint=url)} {picks[url]}")
    return out


def _build(given: Given) -> Policy:
    return PickByIndex(given.section, given.shared)


POLICY = PolicySpec(
    "pick_by_index",
    _build,
    section=PickSection,
    decisions=(PICKED,),
    needs=Needs(shared=Counter, metrics=picks_page),
)
'''


@pytest.fixture
def written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The policy's module, in a directory of the package's `__path__`."""
    where = tmp_path / "more_policies"
    where.mkdir()
    (where / f"{NAME}.py").write_text(textwrap.dedent(MODULE))
    # make test writes bytecode (its Makefile unsets PYTHONDONTWRITEBYTECODE): the import
    # of the module would leave a __pycache__/ beside the one file this test writes.
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(policies, "__path__", [*policies.__path__, str(where)])
    yield where
    sys.modules.pop(f"{policies.__name__}.{NAME}", None)


def config_file(tmp_path: Path, urls: list[str], section: str) -> Path:
    path = tmp_path / f"llmgw-{len(list(tmp_path.glob('llmgw-*.toml')))}.toml"
    path.write_text(f'[router]\nbalancing = "{NAME}"\n{section}' + models_toml({"m": urls}))
    return path


def test_check_config_reads_its_name_and_its_section(
    written: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert NAME in registered()
    assert [p.name for p in written.iterdir()] == [f"{NAME}.py"]  # nothing else written
    urls = ["http://127.0.0.1:1"]
    good = config_file(tmp_path, urls, f"[router.{NAME}]\nindex = 1\n")
    assert cli.run_cli(["check-config", str(good)]) == 0
    assert "ok, 1 model" in capsys.readouterr().out
    mistakes = {
        f"[router.{NAME}]\nindx = 1\n": f"router.{NAME}.indx: is not a known key (did you "
        "mean 'index'?)",
        f"[router.{NAME}]\nindex = -1\n": f"router.{NAME}.index: must be at least 0, not -1",
        f"[router.{NAME}]\nindex = 'x'\n": f"router.{NAME}.index: must be an integer",
    }
    for section, message in mistakes.items():
        assert cli.run_cli(["check-config", str(config_file(tmp_path, urls, section))]) == 2
        assert message in capsys.readouterr().err
    typo = tmp_path / "typo.toml"
    typo.write_text('[router]\nbalancing = "pick_by_idx"\n' + models_toml({"m": urls}))
    assert cli.run_cli(["check-config", str(typo)]) == 2
    assert f"(did you mean '{NAME}'?)" in capsys.readouterr().err
    # Without its module, the name is no policy's.
    sys.modules.pop(f"{policies.__name__}.{NAME}", None)
    policies.__path__.remove(str(written))
    assert cli.run_cli(["check-config", str(config_file(tmp_path, urls, ""))]) == 2
    assert "router.balancing: must be one of cache_aware, " in capsys.readouterr().err
    assert cli.run_cli(["check-config", str(good)]) == 2  # nor its table anyone's
    assert f"router.{NAME}: is not a known key" in capsys.readouterr().err


async def test_a_router_routes_by_it_and_counts_its_decisions(
    written: Path, tmp_path: Path, procs: Procs
) -> None:
    engines = [procs.mock("m"), procs.mock("m")]
    path = config_file(tmp_path, [e.url for e in engines], f"[router.{NAME}]\nindex = 1\n")
    router = Router(load_config(path, policies=PolicyBook()))
    # It reads no prompt and needs no tokens: the router asks no engine for them.
    assert router.tokenizer is None and router.needs.feed() is None
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        server = HTTPServer(router.handle, ServerLimits(), check_head=router.check_head)
        await nursery.start(server.serve, listeners)
        url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            for i in range(4):
                body = {"model": "m", "messages": [{"role": "user", "content": f"hello {i}"}]}
                answer = await client.post("/v1/chat/completions", json=body)
                assert answer.status_code == 200, answer.text
            page = (await client.get("/metrics")).text
        nursery.cancel_scope.cancel()
    second = engines[1].url  # index = 1: the second replica took every request
    (replica,) = [r for r in router.served.balancers["m"].replicas if r.endpoint.url == second]
    labels = {"model": "m", "kind": "picked_by_index"}
    assert metric(page, "llmgw_balancing_decisions_total", **labels) == 4
    assert "picked_by_index (the replica at the configured index)" in page  # its help
    assert metric(page, "llmgw_pick_by_index_picks_total", endpoint=second) == 4
    assert metric(page, "llmgw_pick_by_index_picks_total", endpoint=engines[0].url) == 0
    assert replica.outstanding == 0 and replica.failures == 0


async def test_a_reload_reads_the_file_with_the_policies_it_was_read_with(
    written: Path, tmp_path: Path
) -> None:
    path = config_file(tmp_path, ["http://127.0.0.1:1"], f"[router.{NAME}]\nindex = 1\n")
    config = load_config(path, policies=PolicyBook())
    assert config.policies == PolicyBook()
    applied: list[Config] = []

    async def apply(new: Config, plan: ReloadPlan) -> None:
        applied.append(new)

    await Reloader(config, apply).reload()  # its table is known again
    (section,) = [s for key, s in applied[0].router.policy_sections if key == NAME]
    assert section == config.router.policy_sections[0][1] and section.index == 1  # type: ignore[attr-defined]
