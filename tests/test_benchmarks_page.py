"""docs/benchmarks.md is written by bench/report.py: every table in a generated block, each block's command the one
the report runs, its script present; the page says nothing of who measured, only when, where and at what commit."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import report  # noqa: E402

pytestmark = pytest.mark.unit
PAGE = (ROOT / "docs" / "benchmarks.md").read_text()


def _tables_outside_blocks(text: str) -> list[str]:
    outside, inside = [], None
    for n, line in enumerate(text.splitlines(), 1):
        if m := report.START.match(line):
            inside = m["id"]
        elif line == f"<!-- end: {inside} -->":
            inside = None
        elif line.startswith("|") and inside is None:
            outside.append(f"line {n}: {line[:60]}")
    return outside


def test_every_table_is_in_a_generated_block():
    assert not _tables_outside_blocks(PAGE), _tables_outside_blocks(PAGE)


def test_each_block_runs_a_listed_command_of_a_script_that_exists():
    found = report.blocks_in(PAGE)
    assert [i for i, _ in found] == [b.id for b in report.BLOCKS], "the page's blocks are the report's, in order"
    for block_id, command in found:
        assert command == report.BY_ID[block_id].command, (block_id, command)
        script = shlex.split(command)[1]
        assert (ROOT / script).is_file(), f"{block_id}: {script} does not exist"
        assert f"<!-- end: {block_id} -->" in PAGE, block_id


def test_every_block_says_when_at_what_commit_and_where():
    for block in report.BLOCKS:
        body = PAGE.split(f"<!-- generated: {block.id} |")[1].split(f"<!-- end: {block.id} -->")[0]
        first = body.splitlines()[1]
        if block.gpu:
            assert "from the GPU run's JSON" in first and re.search(r"\d{4}-\d\d-\d\d, commit [0-9a-f]{7}", body)
        else:
            assert re.match(r"_Measured \d{4}-\d\d-\d\d, commit [0-9a-f]{7}.*cores", first), (block.id, first)


def test_every_table_has_as_many_cells_as_its_header():
    for table in re.findall(r"(?:^\|.*\n)+", PAGE, re.M):
        rows = table.splitlines()
        widths = {len(r.strip().strip("|").split(" | ")) for r in rows if not r.startswith("|---")}
        seps = {r.count("|---") for r in rows if r.startswith("|---")}
        assert len(widths | seps) == 1, table[:300]


def test_the_report_rewrites_a_block_and_only_it(tmp_path):
    text = ("# Page\n\nprose\n\n<!-- generated: a | python bench/a.py -->\nold\n<!-- end: a -->\n\nmore\n\n"
            "<!-- generated: b | python bench/b.py -->\nkeep\n<!-- end: b -->\n")
    out = report.replace_block(text, report.Block("a", "python bench/a.py --new"), "| x |\n|---|\n| 1 |\n")
    assert "old" not in out and "| 1 |" in out and "keep" in out and "more" in out
    assert "<!-- generated: a | python bench/a.py --new -->" in out
    with pytest.raises(ValueError, match="no block 'c'"):
        report.replace_block(text, report.Block("c", "python bench/c.py"), "")


def test_no_session_in_the_projects_files():
    hits = []
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if not path.is_file() or parts[0].startswith(".") or parts[0] in ("hetspot-runs", "hetspot-demo", "build") \
                or path.suffix not in (".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".json", ""):
            continue
        if any(p.endswith(".egg-info") or p == "__pycache__" for p in parts):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if re.search(r"\bsession [0-9]", line, re.I):
                hits.append(f"{path.relative_to(ROOT)}:{n}")
    assert not hits, hits
