"""What the benchmarks print: their tables, and progress on stderr; not the noise of the faults they inject.

`quiet(verbose)` (every bench's `-v` turns it off): moto's server logs every request through werkzeug, and Ray
echoes each failed task's or actor's error ("Unhandled error") with its traceback once the ref that held it is
gone; a bench kills nodes and actors on purpose, so both would bury its tables under hundreds of lines; torchft's
Lighthouse (Rust) logs each quorum it forms, several a step.
"""

from __future__ import annotations

import logging
import os


def quiet(verbose: bool = False) -> None:
    if verbose:
        return
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")  # read by every Ray process this one starts
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Lighthouse (bench/peers.py) logs every quorum at INFO
    for name in ("hetspot", "ray"):  # recoveries the bench causes are its subject, not warnings to a reader
        logging.getLogger(name).setLevel(logging.ERROR)
