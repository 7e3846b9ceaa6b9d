"""What every `hetspot` command shares: the consoles and the JSON printer."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console


class _Console(Console):
    """A console that reads COLUMNS when it prints. rich fixes the width from COLUMNS when a Console is made, and
    these live as long as the process: a caller that runs commands in-process (a test's CliRunner, a notebook)
    under another COLUMNS would otherwise get the width of whatever environment imported this module."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._width = kwargs.get("width")


console = _Console()
err_console = _Console(stderr=True)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
