"""Structured log lines: `<time> <level> hetspot.<part> key=value ... message`, naming node, rank and stage."""

from __future__ import annotations

import logging


class _Fields(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return f"{self.extra['prefix']} {msg}", kwargs


def structured_logger(name: str, **fields) -> logging.LoggerAdapter:
    """A logger whose messages start with `key=value` fields (node, rank, stage, ...), for grep or Loki."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    prefix = " ".join(f"{k}={v}" for k, v in fields.items())
    return _Fields(logger, {"prefix": prefix})
