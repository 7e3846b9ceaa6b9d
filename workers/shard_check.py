"""One shard as a worker found it against the job's corpus index (workers/corpus_index.py): used by the local
and the S3 readers alike, so it depends on nothing but the error type."""

from __future__ import annotations

from workers.data_errors import DataError


def check_shard(entry: dict, size: int, version: str, source: str) -> None:
    """A shard as a worker found it against its index entry: DataError in one line where it changed."""
    if size == entry["bytes"] and (not entry["version"] or version == entry["version"]):
        return
    what = (f"{size:,} bytes, indexed at {entry['bytes']:,}" if size != entry["bytes"]
            else f"version {version}, indexed as {entry['version']}")
    raise DataError(f"{source}: shard {entry['path']!r} changed since the job was submitted ({what}); a job reads one "
                    "version of its corpus (a sample is a window chosen by its index): put the shard back as it was, "
                    "or submit the job again on the new corpus (with a new checkpoint.uri: its steps read the old one)")
