"""Numbers as the tables print them: never a negative zero.

A figure computed as a difference (time lost, a speedup's change) can come out as -1e-13 or -0.0, which
`format` prints as "-0", "-0.000" or "-0.0%". A reader takes that sign for a loss; `num` prints it as zero.
"""

from __future__ import annotations


def num(value: float, spec: str = "") -> str:
    """`format(value, spec)`, with a result that rounds to zero printed without its minus sign."""
    out = format(value, spec)
    if out.startswith("-") and not any(c in "123456789" for c in out.split("e")[0]):
        return out[1:]
    return out
