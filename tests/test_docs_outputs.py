"""The outputs quoted in docs/ are what their commands print now (``make docs`` rewrites them).

Every unlabelled fenced block of the tutorial, inspection and examples pages names the
command that prints it (``<!-- output: ... -->``, see ``examples/refresh_docs.py``). The
blocks marked ``cheap`` run in the default test run; the rest (whole trainings, torchrun
worlds, ResNet-50 and LLM plans) are slow cases. A block differs when anything but
durations, percentages, rates and event counts changed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import refresh_docs  # noqa: E402 - examples/ is not a package

PAGES = [ROOT / p for p in refresh_docs.PAGES]


def _blocks() -> list[refresh_docs.Block]:
    return [b for page in PAGES for b in refresh_docs.blocks_of(page)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_quoted_output_names_its_command(page: Path) -> None:
    assert refresh_docs.unmarked_outputs(page) == [], f"{page.name}: output blocks without an <!-- output: ... --> marker"
    for block in refresh_docs.blocks_of(page):
        kind = block.command.split()[0]
        if kind == "console":
            assert any(line.startswith("$ ") for line in block.text.splitlines()), block.name
        elif kind != "page":
            refresh_docs.argv_of(block.command)  # raises for a command make docs cannot run


def test_every_page_has_cheap_blocks_checked_by_default() -> None:
    cheap = {b.page.name for b in _blocks() if b.cheap}
    assert {"tutorial.md", "inspection.md"} <= cheap


def test_normalised_ignores_timings_but_not_results() -> None:
    quoted = "stage 0 cpu:0 18.82K 2.13 ms (98.3% of the step) 12.58step/s [00:00<00:01] 21 events"
    assert refresh_docs.normalised(quoted) == refresh_docs.normalised(
        "stage 0  cpu:0  18.82K  3.9 s (41.0 % of the step) 3.1step/s [00:03<00:00] 20 events"
    )
    assert refresh_docs.normalised(quoted) != refresh_docs.normalised(quoted.replace("18.82K", "18.83K"))
    assert refresh_docs.normalised(quoted) != refresh_docs.normalised(quoted.replace("cpu:0", "cpu:1"))
    bar = "train: 100%|##########| 4/4 [00:00<00:00, 21.68step/s, loss=6.9986, step=0.044s]"
    assert refresh_docs.normalised(bar) == refresh_docs.normalised(bar.replace("6.9986", "7.0070").replace("21.68", "9.1"))
    assert refresh_docs.normalised(bar) != refresh_docs.normalised(bar.replace("4/4", "3/4"))
    row = "   59      48     12        1.363487    1.363486    2.38e-07"
    assert refresh_docs.normalised(row) == refresh_docs.normalised(row.replace("2.38e-07", "0.00e+00"))
    assert refresh_docs.normalised(row) != refresh_docs.normalised(row.replace("2.38e-07", "2.38e-02"))
    assert refresh_docs.normalised(row) != refresh_docs.normalised(row.replace("1.363487", "1.363587"))


def test_filters_cut_keep_and_mark_what_they_leave_out() -> None:
    text = "head\nstep 0\nstep 1\nstep 2\nstep 3\nsummary\ntail"
    assert refresh_docs.filtered(text, [("from", "^step"), ("until", "^tail")]) == "step 0\nstep 1\nstep 2\nstep 3\nsummary"
    assert refresh_docs.filtered(text, [("from", "^step"), ("keep", r"^step [03]|^summary")]) == "step 0\n...\nstep 3\nsummary"
    assert refresh_docs.filtered(text, [("drop", "^step [12]")]) == "head\nstep 0\nstep 3\nsummary\ntail"


def test_a_check_writes_its_pictures_elsewhere(tmp_path: Path) -> None:
    argv = refresh_docs.argv_of("python examples/llm.py --draw docs/img/llm-split.png --out docs/img", tmp_path)
    assert argv[-3:] == [str(tmp_path / "llm-split.png"), "--out", str(tmp_path)]
    assert refresh_docs.argv_of("python examples/llm.py --draw docs/img/llm-split.png")[-1] == "docs/img/llm-split.png"


def test_a_marker_without_its_block_or_with_an_unknown_filter_is_an_error(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- output: fxpipe inspect x -->\ntext\n")
    with pytest.raises(refresh_docs.DocsError, match="right before a ``` block"):
        refresh_docs.blocks_of(page)
    with pytest.raises(refresh_docs.DocsError, match="unknown filter 'grep x'"):
        refresh_docs.parse_marker("fxpipe inspect x | grep x", "page.md:1")


def _check(page: Path, cheap: bool, pictures: Path) -> None:
    stale = [
        f"{block.name}\n--- quoted\n{block.text}\n--- printed now\n{text}"
        for block, text in refresh_docs.outputs(page, lambda b: b.cheap == cheap, pictures)
        if refresh_docs.normalised(text) != refresh_docs.normalised(block.text)
    ]
    assert not stale, "stale output in docs (run `make docs`):\n" + "\n".join(stale)


@pytest.mark.parametrize("page", [p for p in PAGES if any(b.cheap for b in refresh_docs.blocks_of(p))], ids=lambda p: p.name)
def test_cheap_quoted_outputs_are_what_their_commands_print(page: Path, tmp_path: Path) -> None:
    _check(page, cheap=True, pictures=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_quoted_output_is_what_its_command_prints(page: Path, tmp_path: Path) -> None:
    _check(page, cheap=False, pictures=tmp_path)  # the docs' pictures are left as they are
