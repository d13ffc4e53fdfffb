"""README.md and docs/*.md say only what runs: every ```python block runs, every
`pippy-split` command shown parses, every relative link resolves, and tutorials/README.md
lists exactly the tutorials present.

How a block runs is set by an HTML comment on the line before its fence (invisible on GitHub):

- no comment: the block runs in this process, in one namespace shared with the blocks
  before it in the same file, in order, as a reader would run them (in a fresh directory);
- ``<!-- run: ranks=N -->``: the block runs alone on N gloo ranks (``rank`` and
  ``world_size`` defined, the default process group initialised); the blocks of every file
  that ask for N ranks share one spawn of ranks;
- ``<!-- skip: reason -->``: not run, for the reason given (kept rare: at most MAX_SKIPS).

Each docs/ file opens with a runnable example: its first fenced block is a ```python block
that runs (not skipped), before its first ``##`` heading.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from pippy_split.cli import build_parser
from pippy_split.testing import run_ranks
from pippy_split.training.config import build_train_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
MAX_SKIPS = 3
# Pages linked before they land, each with who writes it: a link to one resolves only once it exists.
BEING_WRITTEN: dict[str, str] = {}  # none now: docs/torchtitan.md landed
TEST_COMMAND = 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m tests.streams -x -p no:cacheprovider tests'

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*(run|skip):\s*(.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page: its language, code, first line and marker."""

    page: Path
    lang: str
    code: str
    line: int           # 1-based line of the opening fence
    mark: str = ""      # "", "run" or "skip"
    arg: str = ""       # "ranks=N" for run, the reason for skip

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def ranks(self) -> int:
        m = re.fullmatch(r"ranks=(\d+)", self.arg)
        if self.mark != "run" or m is None:
            raise ValueError(f"{self.name}: a run marker reads <!-- run: ranks=N -->, not {self.arg!r}")
        return int(m.group(1))


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` in order, each with the marker on the line before it."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = _MARK.match(prev)
        out.append(Block(page, m.group(1), "\n".join(lines[i + 1:end]) + "\n", i + 1,
                         mark.group(1) if mark else "", mark.group(2) if mark else ""))
        i = end + 1
    return out


def python_blocks(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang == "python"]


def _exec(block: Block, namespace: dict) -> None:
    exec(compile(block.code, block.name, "exec"), namespace)  # noqa: S102 -- the docs' own examples


# ---- the python blocks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run_in_one_process(page, tmp_path, monkeypatch):
    """The page's unmarked python blocks, in order, in one namespace, in a fresh directory."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for block in python_blocks(page):
        if block.mark == "":
            _exec(block, namespace)


def _run_blocks_on_a_rank(rank: int, world_size: int, named_codes: list[tuple[str, str]]) -> list[str]:
    """Inside a rank: each block alone, in a fresh namespace with rank and world_size."""
    for name, code in named_codes:
        exec(compile(code, name, "exec"), {"__name__": "__docs__", "rank": rank, "world_size": world_size})  # noqa: S102
    return [name for name, _ in named_codes]


def _multi_rank_blocks() -> dict[int, list[Block]]:
    by_ranks: dict[int, list[Block]] = {}
    for page in PAGES:
        for block in python_blocks(page):
            if block.mark == "run":
                by_ranks.setdefault(block.ranks, []).append(block)
    return by_ranks


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks", sorted(_multi_rank_blocks()))
def test_python_blocks_run_on_ranks(ranks, tmp_path, monkeypatch):
    """Every block marked ``run: ranks=N``, one spawn of N ranks for all of them."""
    monkeypatch.chdir(tmp_path)
    todo = [(b.name, b.code) for b in _multi_rank_blocks()[ranks]]
    results = run_ranks(_run_blocks_on_a_rank, ranks, todo, timeout=500)
    assert results == [[name for name, _ in todo]] * ranks


def test_markers_are_well_formed_and_skips_rare():
    skips = []
    for page in PAGES:
        for block in blocks(page):
            if block.mark and block.lang != "python":
                pytest.fail(f"{block.name}: a marker before a ```{block.lang} block (only python blocks run)")
            if block.mark == "skip":
                assert block.arg, f"{block.name}: <!-- skip: ... --> must give its reason"
                skips.append(block.name)
            if block.mark == "run":
                assert block.ranks >= 2, f"{block.name}: ranks=N needs N >= 2 (one process needs no marker)"
    assert len(skips) <= MAX_SKIPS, f"too many skipped blocks (at most {MAX_SKIPS}): {skips}"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_each_docs_page_opens_with_a_runnable_example(page):
    text = page.read_text()
    first = next(iter(blocks(page)), None)
    assert first is not None and first.lang == "python" and first.mark != "skip", (
        f"{page.name}: the first code block must be a ```python example that runs")
    heading = re.search(r"^## ", text, re.M)
    assert heading is None or first.line <= text[:heading.start()].count("\n") + 1, (
        f"{page.name}: the runnable example must come before the first ## heading")


# ---- the commands shown


def _shell_commands(page: Path) -> list[tuple[str, str]]:
    """(where, command) for each shell line and inline code span that starts a command."""
    found = []
    for block in blocks(page):
        if block.lang in ("bash", "sh", "shell", "console"):
            text = re.sub(r"\\\n\s*", " ", block.code)  # continuation lines
            found += [(block.name, line.strip()) for line in text.splitlines()]
    for n, line in enumerate(page.read_text().splitlines(), 1):  # `pippy-split` alone names the tool
        found += [(f"{page.relative_to(ROOT)}:{n}", span) for span in re.findall(r"`([^`\n]+ [^`\n]+)`", line)]
    return found


def _argv_after(words: list[str], head: list[str]) -> list[str] | None:
    for i in range(len(words) - len(head) + 1):
        if words[i:i + len(head)] == head:
            return words[i + len(head):]
    return None


def _strip_comment(command: str) -> str:
    return re.split(r"\s+#\s", " " + command, maxsplit=1)[0].strip()


def _shown_cli_calls() -> list[tuple[str, str, list[str]]]:
    """(where, parser, argv) for every `pippy-split ...` and `... -m pippy_split.train ...` shown."""
    calls = []
    for page in [*PAGES, ROOT / "tutorials" / "README.md"]:
        for where, command in _shell_commands(page):
            for part in re.split(r"&&|\|", _strip_comment(command)):
                if "pippy-split" not in part and "pippy_split.train" not in part:
                    continue
                words = shlex.split(part.strip())
                if words[:1] == ["pippy-split"]:
                    calls.append((where, "pippy-split", words[1:]))
                elif (argv := _argv_after(words, ["-m", "pippy_split.train"])) is not None:
                    calls.append((where, "train", argv))
    return calls


def test_every_pippy_split_command_shown_parses():
    calls = _shown_cli_calls()
    assert {argv[0] for _, parser, argv in calls if parser == "pippy-split" and argv} >= {
        "train", "generate", "plan", "inspect", "simulate"}, "docs/command_line.md shows every subcommand"
    for where, parser, argv in calls:
        build = build_parser if parser == "pippy-split" else build_train_parser
        try:
            build().parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{where}: `{' '.join([parser, *argv])}` does not parse (exit {e.code})")


def test_the_test_command_is_the_one_ci_runs():
    """README's second command is exactly what .ci/run runs; no shown pytest adds -q (pyproject sets it)."""
    assert TEST_COMMAND in (ROOT / "README.md").read_text()
    assert TEST_COMMAND.split(" && ")[-1] in (ROOT / ".ci" / "run").read_text()
    for page in [*PAGES, ROOT / "tutorials" / "README.md"]:
        for where, command in _shell_commands(page):
            words = shlex.split(_strip_comment(command)) if "pytest" in command else []
            assert "-q" not in words, f"{where}: `{command}` adds -q to pyproject's -q (no pass count is printed)"


# ---- links and the tutorials list


def test_relative_links_resolve():
    for page in [*PAGES, ROOT / "tutorials" / "README.md", ROOT / "ARCHITECTURE.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists() and str(path.relative_to(ROOT)) in BEING_WRITTEN:
                continue
            assert path.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"


def test_tutorials_readme_lists_exactly_the_tutorials():
    tutorials = ROOT / "tutorials"
    present = {p.name for p in tutorials.glob("[0-9][0-9]_*.py")}
    listed = set(re.findall(r"\]\((\d\d_[^)]+\.py)\)", (tutorials / "README.md").read_text()))
    assert listed == present, f"tutorials/README.md lists {sorted(listed - present)} (missing) " \
                              f"and not {sorted(present - listed)}"


def test_readme_is_a_way_in():
    """README stays short (the manual is docs/) and links every docs page and the tutorials."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "README.md grew past 250 lines: move the detail to a docs/ page"
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", text))
    pages = {f"docs/{p.name}" for p in DOCS} | set(BEING_WRITTEN)
    assert pages <= linked, f"README.md does not link {sorted(pages - linked)}"
    assert "](tutorials/README.md)" in text and "](ARCHITECTURE.md)" in text


def test_readme_maps_every_package():
    text = (ROOT / "README.md").read_text()
    packages = sorted(p.parent.name for p in (ROOT / "pippy_split").glob("*/__init__.py"))
    missing = [name for name in packages if f"`pippy_split/{name}/`" not in text]
    assert not missing, f"README.md's map of the packages lacks {missing}"
