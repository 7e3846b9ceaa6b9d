"""User-facing errors. The CLI prints their message (no traceback) and exits with `exit_code`."""


class HetspotError(Exception):
    exit_code = 1


class ConfigError(HetspotError):
    """Bad user input: a job file, a plan file, or a flag. Exit code 2."""

    exit_code = 2


class JobFailed(HetspotError):
    """Training failed at run time; the message names the rank and stage."""

    exit_code = 1
