"""Rewrites every output block quoted in docs/ from what its command prints now (`make docs`).

A quoted output is a fenced block without a language, right after a marker line:

    <!-- output: COMMAND [| from REGEX] [| until REGEX] [| drop REGEX] [| keep REGEX] [| cheap] -->

COMMAND is one of
- a command line (``fxpipe ...``, ``python ...``, ``torchrun ...``), run from the repository
  root with this interpreter's ``fxpipe``, ``python`` and ``torch.distributed.run``; the
  block is its standard output;
- ``page``: the page's ```` ```python ```` blocks above the marker, run in order in one
  namespace inside a scratch folder; the block is what the blocks after the previous
  ``page`` marker printed;
- ``console [FOLDER]``: the block itself holds ``$ fxpipe ...`` lines; each is run in
  FOLDER (default the repository root; ``docs/snippets`` holds the model files some name)
  and followed by what it printed, standard output and error.

Filters apply in the marker's order: ``from`` drops the lines before the first match,
``until`` the lines from the first match on, ``drop`` every matching line; ``keep`` keeps the
matching lines and writes one ``...`` for each run of lines left out between kept ones.
``cheap`` marks blocks quick enough for the default test run (``tests/test_docs_outputs.py``).
:func:`normalised` is the comparison the test and ``--check`` make: durations, percentages,
rates and event counts left out. fxpipe's compile-progress lines (printed only by compiles
longer than 2 s) are never part of a block.

    .venv/bin/python examples/refresh_docs.py [--check] [--only REGEX] [PAGE ...]

``FXPIPE_DOCS_KEEP=DIR`` keeps each command's raw output in DIR and reuses it: to tune a
marker's filters without running its command again.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fxpipe.cli import main as fxpipe_main

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("docs/tutorial.md", "docs/inspection.md", "docs/examples.md")
MARKER = re.compile(r"^<!-- output: (.*?) -->$")
FENCE = re.compile(r"^```(\S*)\s*$")
COMMAND_TIMEOUT = 3600
PROGRESS = re.compile(r"^fxpipe: compil(?:ed|ing) ")
PICTURES = "docs/img"


def _shown(path: Path) -> str:
    """``path`` as messages name it: from the repository root when inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


class DocsError(RuntimeError):
    """A marker or its block is malformed, or a documented command failed."""


@dataclass
class Block:
    """One quoted output: the page, the marker's line (0-based), the command and filters,
    and the fenced block's lines (``start``..``end``, the fences excluded)."""

    page: Path
    line: int
    command: str
    filters: list[tuple[str, str]]
    start: int
    end: int
    cheap: bool
    text: str = ""
    code_above: list[tuple[int, str]] = field(default_factory=list)  # (line, source) of python blocks

    @property
    def name(self) -> str:
        return f"{_shown(self.page)}:{self.line + 1}: {self.command}"


def parse_marker(body: str, where: str) -> tuple[str, list[tuple[str, str]], bool]:
    """(command, filters, cheap) from a marker's text. Raises DocsError naming ``where``."""
    parts = [p.strip() for p in body.split(" | ")]
    command, filters, cheap = parts[0], [], False
    for part in parts[1:]:
        word, _, arg = part.partition(" ")
        if word == "cheap" and not arg:
            cheap = True
        elif word in ("keep", "drop", "from", "until") and arg:
            re.compile(arg)
            filters.append((word, arg))
        else:
            raise DocsError(f"{where}: unknown filter {part!r} in the output marker; use keep/drop/from/until REGEX or cheap")
    if not command:
        raise DocsError(f"{where}: the output marker names no command")
    return command, filters, cheap


def blocks_of(page: Path) -> list[Block]:
    """Every marked block of ``page``, with the python code above each. Raises DocsError for a
    marker not followed by an unlabelled fenced block."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    code: list[tuple[int, str]] = []
    k = 0
    while k < len(lines):
        fence = FENCE.match(lines[k])
        marker = MARKER.match(lines[k])
        if marker:
            where = f"{_shown(page)}:{k + 1}"
            command, filters, cheap = parse_marker(marker.group(1), where)
            if k + 1 >= len(lines) or lines[k + 1] != "```":
                raise DocsError(f"{where}: an output marker must stand right before a ``` block (no language)")
            end = _closing(lines, k + 1, where)
            found.append(Block(page, k, command, filters, k + 2, end, cheap, "\n".join(lines[k + 2 : end]), list(code)))
            k = end + 1
            continue
        if fence:
            end = _closing(lines, k, f"{_shown(page)}:{k + 1}")
            if fence.group(1) == "python":
                code.append((k, "\n".join(lines[k + 1 : end])))
            k = end + 1
            continue
        k += 1
    return found


def unmarked_outputs(page: Path) -> list[int]:
    """1-based lines of the unlabelled fenced blocks of ``page`` with no marker before them."""
    lines = page.read_text().splitlines()
    missing, k = [], 0
    while k < len(lines):
        fence = FENCE.match(lines[k])
        if fence:
            if fence.group(1) == "" and not (k and MARKER.match(lines[k - 1])):
                missing.append(k + 1)
            k = _closing(lines, k, str(page)) + 1
            continue
        k += 1
    return missing


def _closing(lines: list[str], opening: int, where: str) -> int:
    for j in range(opening + 1, len(lines)):
        if lines[j].startswith("```"):
            return j
    raise DocsError(f"{where}: a ``` block is not closed")


# ---------------------------------------------------------------------------- running
def argv_of(command: str, pictures: Path | None = None) -> list[str]:
    """The process a documented command line runs: this interpreter's tools. ``pictures``:
    a folder for the files the command writes under ``docs/img`` instead (a check that
    leaves the docs as they are)."""
    words = shlex.split(command)
    if pictures is not None:
        words = [str(pictures) + w[len(PICTURES) :] if w.startswith(PICTURES) else w for w in words]
    program, rest = words[0], words[1:]
    python = sys.executable
    if program == "fxpipe":
        script = Path(python).parent / "fxpipe"  # the installed command: its name in its messages
        if script.exists():
            return [str(script), *rest]
        return [python, "-c", "import sys; from fxpipe.cli import main; sys.argv[0] = 'fxpipe'; sys.exit(main())", *rest]
    if program in ("python", ".venv/bin/python"):
        return [python, *rest]
    if program in ("torchrun", ".venv/bin/torchrun"):
        return [python, "-m", "torch.distributed.run", *rest]
    raise DocsError(f"cannot run {command!r}: documented commands start with fxpipe, python or torchrun")


_RUNS: dict[tuple[str, Path, bool, Path | None], str] = {}  # one run per command and way of reading it


def run_command(command: str, cwd: Path = ROOT, merge_stderr: bool = False, pictures: Path | None = None) -> str:
    """What ``command`` prints (stdout, and stderr after it when ``merge_stderr``), with
    carriage-return redraws (progress bars) reduced to their last state; a command quoted
    twice (a summary and its explain) runs once. Raises DocsError when a command that is
    not an error example fails."""
    key = (command, cwd, merge_stderr, pictures)
    if key not in _RUNS:
        kept = os.environ.get("FXPIPE_DOCS_KEEP")  # a folder: raw outputs kept there and reused (tuning filters)
        path = Path(kept) / hashlib.sha1(repr(key).encode()).hexdigest() if kept else None
        if path is not None and path.exists():
            _RUNS[key] = path.read_text()
        else:
            _RUNS[key] = _run(command, cwd, merge_stderr, pictures)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(_RUNS[key])
    return _RUNS[key]


def _run(command: str, cwd: Path, merge_stderr: bool, pictures: Path | None) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.update(COLUMNS="100", PYTHONUNBUFFERED="1")  # both streams in the order written
    stderr = subprocess.STDOUT if merge_stderr else subprocess.PIPE
    done = subprocess.run(argv_of(command, pictures), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=COMMAND_TIMEOUT)
    if done.returncode != 0 and not merge_stderr:
        raise DocsError(f"`{command}` exited with {done.returncode}:\n{done.stderr[-2000:]}")
    return _printed(done.stdout)


def run_console(text: str, folder: Path = ROOT) -> str:
    """Each ``$ command`` line of a console block followed by what it prints now, run in
    ``folder``: an ``fxpipe`` command in this process (``fxpipe.cli.main``; seconds instead of
    a fresh interpreter's import of torch), any other as :func:`run_command` runs it."""
    commands = [line[2:] for line in text.splitlines() if line.startswith("$ ")]
    if not commands:
        raise DocsError("a console block holds no `$ command` line")
    printed = [run_fxpipe_here(c, folder) if c.startswith("fxpipe ") else run_command(c, folder, merge_stderr=True) for c in commands]
    return "\n".join(f"$ {c}\n{out}" for c, out in zip(commands, printed))


def run_fxpipe_here(command: str, folder: Path) -> str:
    """What an ``fxpipe`` command line prints, standard output and error in the order written,
    run by ``fxpipe.cli.main`` in this process with ``folder`` as the current folder."""
    out = io.StringIO()
    path = list(sys.path)
    with _inside(folder), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            fxpipe_main(shlex.split(command)[1:])
        except SystemExit:  # argparse's own errors
            pass
        finally:
            sys.path[:] = path  # the model file's folder leaves with the command
    return _printed(out.getvalue())


def _printed(out: str) -> str:
    """Printed text as a terminal leaves it: a progress bar's last state; without fxpipe's
    compile-progress lines, which only compiles longer than 2 s print."""
    lines = [line.split("\r")[-1] for line in out.rstrip("\n").split("\n")]
    return "\n".join(line for line in lines if not PROGRESS.match(line))


class Page:
    """The python blocks of one page, run once in order in one namespace (in a scratch
    folder), each block's printed output kept by its line."""

    def __init__(self) -> None:
        self.namespace: dict = {"__name__": "__docs__"}
        self.printed: dict[int, str] = {}
        self.scratch = tempfile.TemporaryDirectory(prefix="fxpipe-docs-")

    def output(self, block: Block, previous_line: int) -> str:
        """What the python blocks between ``previous_line`` and ``block`` print."""
        for line, source in block.code_above:
            if line not in self.printed:
                self.printed[line] = self._run(source, f"{block.page.name}:{line + 1}")
        return "".join(self.printed[line] for line, _ in block.code_above if line > previous_line).rstrip("\n")

    def _run(self, source: str, where: str) -> str:
        out = io.StringIO()
        with _inside(Path(self.scratch.name)), contextlib.redirect_stdout(out):
            exec(compile(source, where, "exec"), self.namespace)  # noqa: S102 - the page's own code
        return out.getvalue()


@contextlib.contextmanager
def _inside(folder: Path) -> Iterator[None]:
    here = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(here)


def filtered(text: str, filters: Sequence[tuple[str, str]]) -> str:
    """``text`` through the marker's filters (see the module doc)."""
    lines = text.splitlines()
    for word, pattern in filters:
        regex = re.compile(pattern)
        hits = [k for k, line in enumerate(lines) if regex.search(line)]
        if word == "from":
            lines = lines[hits[0] :] if hits else []
        elif word == "until":
            lines = lines[: hits[0]] if hits else lines
        elif word == "drop":
            lines = [line for k, line in enumerate(lines) if k not in set(hits)]
        else:
            kept: list[str] = []
            for k, line in enumerate(lines):
                if k in hits:
                    kept.append(line)
                elif kept and kept[-1] != "..." and any(h > k for h in hits):
                    kept.append("...")
            lines = kept
    return "\n".join(lines)


def produce(block: Block, page: Page, previous_page_line: int, pictures: Path | None = None) -> str:
    """What ``block`` should hold now: without trailing spaces, blank lines at its ends.
    ``pictures``: where its command writes what it would write under ``docs/img``."""
    if block.command == "page":
        raw = page.output(block, previous_page_line)
    elif block.command.split()[0] == "console":
        folder = block.command.split(maxsplit=1)[1:]
        raw = run_console(block.text, ROOT / folder[0] if folder else ROOT)
    else:
        raw = run_command(block.command, pictures=pictures)
    return "\n".join(line.rstrip() for line in filtered(raw, block.filters).splitlines()).strip("\n")


def outputs(
    path: Path, wanted: Callable[[Block], bool] = lambda block: True, pictures: Path | None = None
) -> Iterator[tuple[Block, str]]:
    """Each marked block of the page at ``path`` that is ``wanted``, with what it should hold
    now. A ``page`` block runs the page's code up to it. ``pictures``: a folder for what the
    commands would write under ``docs/img`` (None: there, as ``make docs`` wants)."""
    page, previous = Page(), -1
    try:
        for block in blocks_of(path):
            asked = wanted(block)
            if block.command == "page":
                if asked:
                    yield block, produce(block, page, previous, pictures)
                previous = block.line
            elif asked:
                yield block, produce(block, page, previous, pictures)
    finally:
        page.scratch.cleanup()


# ---------------------------------------------------------------------------- comparing
_VARYING = [
    (re.compile(r"\[\d+:\d\d<[^\]]*\]"), "[<progress>]"),  # a progress bar's clock, rate and last step's figures
    (re.compile(r"\d+:\d\d(?:<\d+:\d\d)?"), "<clock>"),
    (re.compile(r"[-+]?\d[\d,.]*(?:e[-+]?\d+)?\s?(?:µs|us|ms|s|min|h)\b"), "<time>"),
    (re.compile(r"[-+]?\d[\d.]*\s?%"), "<share>"),
    (re.compile(r"[-+]?\d[\d.]*\s?(?:step|steps|samples|tokens|it)/s\b"), "<rate>"),
    (re.compile(r"[-+]?\d[\d.]*x\b"), "<ratio>"),
    (re.compile(r"\b\d+ events\b"), "<n> events"),  # a measured timeline counts its waits too
    # float rounding noise (a float32 loss against eager's differs by ulps, in either direction)
    (re.compile(r"[-+]?(?:\d(?:\.\d+)?e-(?:0[5-9]|[1-9]\d)|0(?:\.0+)?e[-+]0+)\b"), "<rounding>"),
    (re.compile(r"[ \t]+"), " "),
]


def normalised(text: str) -> str:
    """``text`` without what varies from run to run: durations, percentages, rates, speed
    ratios, event counts (a measured timeline counts its waits), rounding noise (numbers
    below 1e-4, zero included, written with an exponent), what a progress bar shows
    after its count (clock, rate, the last step's figures) and column padding."""
    lines = []
    for line in text.strip("\n").splitlines():
        for regex, stand_in in _VARYING:
            line = regex.sub(stand_in, line)
        lines.append(line.strip())
    return "\n".join(lines)


def rewrite(path: Path, new: dict[int, str]) -> None:
    """Replace the blocks of the page at ``path`` (by marker line) with ``new`` texts."""
    lines = path.read_text().splitlines()
    for block in sorted(blocks_of(path), key=lambda b: -b.line):
        if block.line in new:
            lines[block.start : block.end] = new[block.line].splitlines()
    path.write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", default=list(PAGES), help="markdown pages (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="rewrite nothing (pictures go to a scratch folder); exit 1 when a block differs beyond timings")
    parser.add_argument("--only", type=re.compile, help="only the blocks whose 'page:line: command' matches this regex")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fxpipe-docs-pictures-") as scratch:
        stale = sum(refresh(ROOT / name, args.only, Path(scratch) if args.check else None) for name in args.pages)
    return 1 if args.check and stale else 0


def refresh(path: Path, only: re.Pattern[str] | None, pictures: Path | None) -> int:
    """Print whether each marked block of the page at ``path`` (those whose name matches
    ``only``) is current; rewrite the page unless ``pictures`` (a check) is given. Returns
    how many blocks are stale or unmarked."""
    stale = 0
    for line in unmarked_outputs(path):
        print(f"{_shown(path)}:{line}: an output block without an <!-- output: ... --> marker", file=sys.stderr)
        stale += 1
    new = {}
    for block, text in outputs(path, lambda b: only is None or bool(only.search(b.name)), pictures):
        same = normalised(text) == normalised(block.text)
        print(f"{'same   ' if same else 'changed'} {block.name}", flush=True)
        stale += not same
        new[block.line] = text
    if pictures is None:
        rewrite(path, new)
    return stale


if __name__ == "__main__":
    sys.exit(main())
