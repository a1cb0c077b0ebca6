"""The README's examples as a user meets them: the Python client example under Quick start
runs as written against `make demo` (only the port changed, to a free one), and so does
the README's first block, the Responses API and Anthropic's Messages (its host, model
and key made the demo's), and every `conf/...` path, `make` target and docs/ link the
README and docs/ name exists."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from test_demo import free_pair, read_banner, start_demo

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
DEMO_URL = "http://127.0.0.1:8080/v1"
# Made by `llmgw-server certs init conf/certs` (and kept out of git): named, never shipped.
MADE_BY_CERTS = "conf/certs"


def section(markdown: str, heading: str) -> str:
    """The text under a `## heading`, up to the next heading of that level."""
    start = markdown.index(f"\n## {heading}\n")
    end = markdown.find("\n## ", start + 1)
    return markdown[start : end if end != -1 else len(markdown)]


# The README's first block names a gateway, a model and a key of its own: the demo's.
FIRST_BLOCK_AS_DEMO = {
    "http://gw:8080": "http://127.0.0.1:8080",
    '"llama"': '"demo-model"',
}


def first_block() -> str:
    """The README's first ```python block, made to run against the demo: its names
    imported, KEY any key (the demo asks for none) and its addresses the demo's."""
    match = re.search(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)
    assert match, "no ```python block in the README"
    code = match[1]
    for theirs, demos in FIRST_BLOCK_AS_DEMO.items():
        assert theirs in code, (theirs, code)
        code = code.replace(theirs, demos)
    return "import anthropic\nimport openai\n\nKEY = 'none'\n" + code


def quick_start_client() -> str:
    quick_start = section(README.read_text(), "Quick start")
    match = re.search(r"^```python\n(.*?)^```", quick_start, re.S | re.M)
    assert match, "no ```python block under Quick start"
    return match[1]


def code_spans(markdown: str) -> list[str]:
    """Every fenced block's lines and every inline code span."""
    fenced = re.findall(r"^```[a-z]*\n(.*?)^```", markdown, re.S | re.M)
    prose = re.sub(r"^```[a-z]*\n.*?^```", "", markdown, flags=re.S | re.M)
    return [line for block in fenced for line in block.splitlines()] + re.findall(
        r"`([^`\n]+)`", prose.replace("\n", " ")
    )


def test_the_quick_start_client_and_the_first_block_run_against_the_demo(
    tmp_path: Path,
) -> None:
    code = quick_start_client()
    assert code.count(DEMO_URL) == 1, code  # the demo's default address, as a user runs it
    first = first_block()
    assert ".responses.create(" in first and ".messages.create(" in first, first
    port = free_pair()
    demo = start_demo(port, tmp_path)
    try:
        read_banner(demo)
        url = f"http://127.0.0.1:{port}/v1"
        ran = subprocess.run(
            [sys.executable, "-c", code.replace(DEMO_URL, url)],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=tmp_path,
        )
        assert ran.returncode == 0, ran.stderr
        # The mock engine answers as a function of the prompt: the stream the example
        # printed is the whole answer the same request gets unstreamed.
        whole = httpx.post(
            f"{url}/chat/completions",
            json={"model": "demo-model", "messages": [{"role": "user", "content": "hello"}]},
            timeout=20,
        )
        assert whole.status_code == 200, whole.text
        answer = whole.json()["choices"][0]["message"]["content"]
        assert answer and ran.stdout == answer, (ran.stdout, answer)
        # The README's first block: responses.create and messages.create (issue 36: the
        # demo's mock engines answered both with 404).
        headline = subprocess.run(
            [
                sys.executable,
                "-c",
                first.replace("http://127.0.0.1:8080", f"http://127.0.0.1:{port}"),
            ],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=tmp_path,
        )
        assert headline.returncode == 0, headline.stderr
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGTERM)
            try:
                demo.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(demo.pid, signal.SIGKILL)
                demo.wait()
    assert demo.returncode == 0
    assert list(tmp_path.iterdir()) == []  # the demo removed its directory


def test_every_conf_path_named_exists() -> None:
    named: set[str] = set()
    for doc in (README, *DOCS):
        for path in re.findall(r"(?<![\w/.])conf/[\w./{},-]*[\w}]", doc.read_text()):
            named.add(path)
    assert "conf/fleet.toml" in named and "conf/systemd/llmgw-server.service" in named
    missing = []
    for path in sorted(named):
        if path == MADE_BY_CERTS or path.startswith(MADE_BY_CERTS + "/"):
            continue
        # conf/x/{a,b}.toml names each of a and b.
        head, _, rest = path.partition("{")
        names, _, tail = rest.partition("}")
        expanded = [head + n + tail for n in names.split(",")] if rest else [path]
        missing += [p for p in expanded if not (ROOT / p).exists()]
    assert missing == [], missing


def test_every_make_target_named_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+)\s*:(?!=)", makefile, re.M))
    named: set[str] = set()
    for doc in (README, *DOCS):
        for code in code_spans(doc.read_text()):
            command = re.match(r"\s*(?:sudo\s+)?make((?:\s+[\w-]+(?=\s|$))*)", code)
            if command:
                named.update(command[1].split())
    assert {"demo", "test", "lint"} <= named, named
    assert named - targets == set()


def test_every_docs_link_leads_to_a_file() -> None:
    links = re.findall(r"\]\((docs/[^)#]+)", README.read_text())
    for doc in DOCS:
        links += [f"docs/{x}" for x in re.findall(r"\]\(([\w-]+\.md)", doc.read_text())]
    assert links and [x for x in links if not (ROOT / x).is_file()] == []
    assert {f"docs/{d.name}" for d in DOCS} <= set(links)  # every page is reachable


def test_every_curl_line_that_acts_on_the_admin_api_sends_json() -> None:
    # The control port refuses an action without Content-Type: application/json (415).
    posts = []
    for doc in (README, *DOCS):
        for code in code_spans(doc.read_text().replace("\\\n", " ")):
            if "curl" in code and "/v1/admin/" in code and ("-X POST" in code or " -d " in code):
                posts.append(code)
    assert len(posts) >= 2, posts  # the README's drain, control-plane.md's
    assert [c for c in posts if "content-type: application/json" not in c.lower()] == []
