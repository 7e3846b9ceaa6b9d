"""`hetspot data prepare`: text in, token shards out (registered as a sub-app by orchestrator/cli/main.py)."""

from __future__ import annotations

import json
import sys

import typer

data_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                       help="Training data: tokenize text into the shards a job reads.")


def prepare(
    inputs: list[str] = typer.Argument(..., help="text files, .jsonl files (one document a line) or folders of them"),
    tokenizer: str = typer.Option(..., "--tokenizer", help="a local tokenizer.json (Hugging Face tokenizers)"),
    out: str = typer.Option(..., "--out", help="a new local folder, or s3://BUCKET/PREFIX/"),
    field: str = typer.Option("text", "--field", help=".jsonl inputs: the field holding a document's text"),
    eot: str | None = typer.Option(None, "--eot", help="the end-of-text token put after each document (default: "
                                   "the first of <|endoftext|>, </s>, <eos>, [SEP] the tokenizer has)"),
    dtype: str = typer.Option("auto", "--dtype", help="uint16, uint32, or auto: uint16 where the vocabulary fits"),
    shard_mib: float = typer.Option(256.0, "--shard-mib", min=0.001, help="the largest shard, in MiB"),
    endpoint_url: str | None = typer.Option(None, "--endpoint-url", help="S3 endpoint for an s3:// --out"),
    as_json: bool = typer.Option(False, "--json", help="print what was written as JSON"),
) -> None:
    """Tokenize documents into flat token shards (shard-00000.bin, ...): a job trains on them with
    `data: {kind: tokens, path: OUT, dtype: ...}` and the model's vocab_size at least the tokenizer's."""
    from rich.progress import Progress, TextColumn, TimeElapsedColumn

    from orchestrator.errors import ConfigError
    from workers.data_errors import DataError
    from workers.prepare import prepare as run

    with Progress(TextColumn("{task.description}"), TimeElapsedColumn(), transient=True,
                  disable=as_json or not sys.stderr.isatty()) as bar:
        task = bar.add_task("tokenizing", total=None)

        def progress(docs: int, tokens: int) -> None:
            bar.update(task, description=f"tokenizing: {docs:,} documents, {tokens:,} tokens")

        try:
            got = run(inputs, tokenizer, out, field, eot, dtype, int(shard_mib * 2**20), endpoint_url, progress)
        except DataError as e:
            raise ConfigError(str(e)) from None
    if as_json:
        sys.stdout.write(json.dumps(got.__dict__, indent=2) + "\n")
        return
    typer.echo(f"{got.tokens:,} tokens of {got.documents:,} documents in {len(got.shards)} shard(s) under {out} "
               f"({got.dtype}; vocabulary {got.vocab_size:,}, end-of-text id {got.eot_id}); train on them with "
               f"data: {{kind: tokens, path: {out}, dtype: {got.dtype}}} and model.vocab_size >= {got.vocab_size}")
