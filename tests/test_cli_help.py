"""Every command's help reads at 80 columns, and no table prints a negative zero."""

from __future__ import annotations

import io
import re

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from orchestrator.cli.main import app
from orchestrator.drills.report import simulate_tables
from orchestrator.numbers import num

pytestmark = pytest.mark.unit
WIDTH, NARROWEST = 80, 30


def _commands(cmd, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [path]
    for name, sub in getattr(cmd, "commands", {}).items():  # a group (typer carries its own click)
        out += _commands(sub, (*path, name))
    return out


def _description_columns(text: str) -> list[int]:
    """Where each description starts in the help's Arguments/Options/Commands lists (click's two columns)."""
    starts, listing = [], False
    for line in text.splitlines():
        if re.fullmatch(r"[A-Z][A-Za-z ]*:", line):
            listing = line in ("Arguments:", "Options:", "Commands:")
            continue
        if not listing or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent > 2:  # a description's continuation, or one that begins under a long option
            starts.append(indent)
        elif m := re.match(r"  \S.*?\s{2,}(\S)", line):
            starts.append(m.start(1))
    return starts


def test_every_help_reads_at_80_columns():
    commands = _commands(typer.main.get_command(app))
    assert len(commands) >= 20, commands  # the tree was walked, sub-apps included
    runner = CliRunner()
    for path in commands:
        res = runner.invoke(app, [*path, "--help"], prog_name="hetspot", terminal_width=WIDTH,
                            env={"COLUMNS": str(WIDTH)})
        name = " ".join(("hetspot", *path))
        assert res.exit_code == 0, (name, res.output)
        too_long = [ln for ln in res.output.splitlines() if len(ln) > WIDTH]
        assert not too_long, f"`{name} --help` runs past {WIDTH} columns: {too_long}"
        starts = _description_columns(res.output)
        assert starts, f"`{name} --help` lists nothing:\n{res.output}"
        narrowest = WIDTH - max(starts)
        assert narrowest >= NARROWEST, f"`{name} --help`: a description column {narrowest} wide:\n{res.output}"


def test_the_column_check_catches_a_squeezed_column():
    squeezed = "Options:\n  --trace <path>" + " " * 40 + "a spot trace\n" + " " * 62 + "(Parcae)\n"
    assert WIDTH - max(_description_columns(squeezed)) < NARROWEST


def test_no_negative_zero_in_a_number_or_a_table():
    assert [num(-0.0, ".3f"), num(-1e-13, ".0f"), num(-0.0004, ".1%"), num(-0.6, ".0f"), num(-2.5, ".1f")] == \
        ["0.000", "0", "0.0%", "-1", "-2.5"]
    zero = {"tokens": -0.0, "goodput": -0.0, "recoveries": 0, "down_s": -1e-13, "lost_s": -0.0}
    result = {"trace": "t.jsonl", "fleet": {"gpus": 4, "mix": "4x L4"}, "model": "7b", "events": 0, "hours": 0.0,
              "strategies": {"oracle": dict(zero), "hetspot": dict(zero)}, "assumptions": {}, "sim_s": 0.0}
    buf = io.StringIO()
    simulate_tables(result, Console(file=buf, width=120))
    assert "-0" not in buf.getvalue(), buf.getvalue()


def _doc_commands() -> list[tuple[str, list[str]]]:
    """Every `hetspot ...` line of a ```bash block in README.md and docs/*.md, with its file."""
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for line in block.splitlines():
                for part in line.split("&&"):
                    part = part.split("  #")[0].split(" # ")[0].strip()
                    if part.startswith("hetspot "):
                        out.append((path.name, shlex.split(part)))
    return out


def test_every_command_the_docs_show_exists_with_its_flags():
    """The README and every page of docs/ name only commands and flags the CLI has (what each does is the pages'
    own tests: the README walk-through, the deploy runbook)."""
    cmds = _doc_commands()
    assert len({page for page, _ in cmds}) >= 5, cmds  # README, planning, cluster, watching, deploy, drills, ...
    runner = CliRunner()
    groups = {"deploy", "checkpoints", "data"}
    for page, argv in cmds:
        words = [w for w in argv[1:] if not w.startswith("-")]
        sub = words[:2] if words and words[0] in groups else words[:1]
        res = runner.invoke(app, [*sub, "--help"], terminal_width=200, env={"COLUMNS": "200"})
        assert res.exit_code == 0, f"{page}: `{' '.join(argv)}`: no command `hetspot {' '.join(sub)}`"
        for flag in (w.split("=")[0] for w in argv if w.startswith("--")):
            assert flag in res.output, f"{page}: `{' '.join(argv)}`: `hetspot {' '.join(sub)}` has no {flag}"
