"""`hetspot data prepare`: text in, token shards out (what `data: {kind: tokens, path: FOLDER}` trains on).

Inputs are text files (one document each), JSON-lines files (`.jsonl`, one document per line, its text under
`field`), or folders of them (the files directly in a folder, in name order). Each document is tokenized with a
Hugging Face `tokenizers` tokenizer read from a local `tokenizer.json` (a tokenizer cannot be fetched from the hub
on every machine: the user points at the file), followed by the end-of-text token, and the tokens are written as
flat `uint16` arrays (`uint32` where the vocabulary does not fit in 16 bits) in shards of at most `shard_bytes`,
named `shard-00000.bin`, ... in a new local folder or under an `s3://BUCKET/PREFIX/`. Documents are encoded in
batches (up to 8,192 documents or 16 MiB of text) with the tokenizer's own batch encoding (without character
offsets), which runs on all cores (its Rust thread pool). (Reading the next batch beside the encoding was tried:
on two cores the reading thread takes a core from the encoder and the whole runs slower.)
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workers.data_errors import DataError

EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")
BATCH_DOCS = 8192  # documents per encode call (its thread pool needs many to keep every core busy)
BATCH_CHARS = 16 << 20  # or this much text, whichever comes first


@dataclass
class Prepared:
    shards: list[str]
    documents: int
    tokens: int
    dtype: str
    vocab_size: int
    eot_id: int


def input_files(inputs: list[str]) -> list[Path]:
    """The files the inputs name: each file, and the files directly in each folder (hidden ones left out)."""
    out: list[Path] = []
    for name in inputs:
        p = Path(name).expanduser()
        if p.is_dir():
            found = [f for f in sorted(p.iterdir()) if f.is_file() and not f.name.startswith(".")]
            if not found:
                raise DataError(f"input {name!r} is a folder with no files in it; give text or .jsonl files")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise DataError(f"input {name!r} does not exist; give text files, .jsonl files or folders of them")
    return out


def documents(files: list[Path], field: str) -> Iterator[str]:
    """Each file's documents: a `.jsonl` file's lines' `field`, any other file whole."""
    for f in files:
        if f.suffix in (".jsonl", ".ndjson"):
            with f.open(encoding="utf-8") as fh:
                for i, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except ValueError:
                        raise DataError(f"{f}:{i}: not a JSON line; a .jsonl input holds one JSON object a "
                                        "line") from None
                    text = row.get(field) if isinstance(row, dict) else None
                    if not isinstance(text, str):
                        raise DataError(f"{f}:{i}: no text field {field!r}; name the field with --field")
                    yield text
        else:
            try:
                yield f.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{f}: not UTF-8 text (byte {e.start}); give text files or .jsonl") from None


def load_tokenizer(path: str):
    """A `tokenizers.Tokenizer` from a local tokenizer.json."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"--tokenizer {path!r} is not a file: give the path of a tokenizer.json (a tokenizer on "
                        "the Hugging Face hub cannot be downloaded on every machine: fetch its tokenizer.json once, "
                        "e.g. with `huggingface-cli download MODEL tokenizer.json`, and point at that)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError("hetspot data prepare needs the `tokenizers` package: pip install tokenizers") from None
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception type for a bad file
        raise DataError(f"--tokenizer {path!r} is not a tokenizer.json tokenizers can read "
                        f"({str(e).splitlines()[0][:200]})") from None


def eot_id(tokenizer, eot: str | None) -> int:
    """The end-of-text token's id: `eot`, else the first of EOT_CANDIDATES the vocabulary has."""
    for t in ([eot] if eot else EOT_CANDIDATES):
        i = tokenizer.token_to_id(t)
        if i is not None:
            return int(i)
    if eot:
        raise DataError(f"--eot {eot!r} is not a token of this tokenizer; give the token its vocabulary uses "
                        "between documents")
    raise DataError(f"the tokenizer has none of {', '.join(EOT_CANDIDATES)}; name its end-of-text token with --eot")


def pick_dtype(vocab_size: int, dtype: str) -> str:
    if dtype == "auto":
        return "uint16" if vocab_size <= 1 << 16 else "uint32"
    if dtype not in ("uint16", "uint32"):
        raise DataError(f"--dtype {dtype!r}: use uint16, uint32 or auto")
    if dtype == "uint16" and vocab_size > 1 << 16:
        raise DataError(f"--dtype uint16 cannot hold this tokenizer's {vocab_size:,} token ids (at most 65,536); "
                        "use --dtype uint32 (or auto)")
    return dtype


class _Shards:
    """Token arrays appended and cut into shards of at most `shard_tokens`, written locally or to S3."""

    def __init__(self, out: str, dtype: str, shard_tokens: int, endpoint_url: str | None):
        self.out, self.dtype, self.shard_tokens, self.endpoint_url = out, np.dtype(dtype), shard_tokens, endpoint_url
        self.buf: list[np.ndarray] = []
        self.held = 0
        self.written: list[str] = []
        self._client: Any = None

    def add(self, tokens: np.ndarray) -> None:
        while len(tokens):
            take = min(len(tokens), self.shard_tokens - self.held)
            self.buf.append(tokens[:take])
            self.held += take
            tokens = tokens[take:]
            if self.held == self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        if not self.held:
            return
        data = np.concatenate(self.buf).astype(self.dtype).tobytes()
        name = f"shard-{len(self.written):05d}.bin"
        if self.out.startswith("s3://"):
            import io

            from workers.s3_data import new_s3_client

            bucket, _, prefix = self.out[len("s3://"):].partition("/")
            if self._client is None:
                self._client = new_s3_client(self.endpoint_url)
            self._client.upload_fileobj(io.BytesIO(data), bucket, prefix + name)
            self.written.append(self.out + name)
        else:
            path = Path(self.out) / name
            path.write_bytes(data)
            self.written.append(str(path))
        self.buf, self.held = [], 0


def check_out(out: str, endpoint_url: str | None = None) -> str:
    """`--out`: a new or empty local folder (made here), or an s3:// prefix (given a trailing "/") holding no
    object yet."""
    if out.startswith("s3://"):
        from workers.s3_data import list_prefix

        out = out if out.endswith("/") else out + "/"
        try:
            there = list_prefix(out, endpoint_url)
        except DataError as e:
            raise DataError(str(e).replace("data.path", "--out")) from None
        except ValueError:
            there = []
        if there:
            raise DataError(f"--out {out} already holds {len(there)} object(s); give a new prefix (nothing was "
                            "written)")
        return out
    p = Path(out).expanduser()
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise DataError(f"--out {out} exists and is not an empty folder; give a new path (nothing was written)")
    p.mkdir(parents=True, exist_ok=True)
    return str(p)


def prepare(inputs: list[str], tokenizer_path: str, out: str, field: str = "text", eot: str | None = None,
            dtype: str = "auto", shard_bytes: int = 256 << 20, endpoint_url: str | None = None,
            progress: Callable[[int, int], None] = lambda docs, tokens: None) -> Prepared:
    """Tokenize `inputs` into shards under `out` (see the module's docstring); DataError on bad input, before
    anything is written where it can be found out first (the tokenizer, the dtype, the inputs, `out`)."""
    files = input_files(inputs)
    tok = load_tokenizer(tokenizer_path)
    vocab = int(tok.get_vocab_size(with_added_tokens=True))
    kind = pick_dtype(vocab, dtype)
    eos = eot_id(tok, eot)
    out = check_out(out, endpoint_url)
    shards = _Shards(out, kind, max(1, shard_bytes // np.dtype(kind).itemsize), endpoint_url)
    docs = tokens = 0
    batch: list[str] = []

    encode_fn = getattr(tok, "encode_batch_fast", tok.encode_batch)  # (no character offsets: faster, same ids)

    def encode(texts: list[str]) -> None:
        nonlocal docs, tokens
        encoded = encode_fn(texts, add_special_tokens=False)
        lengths = np.fromiter((len(e.ids) for e in encoded), dtype=np.int64, count=len(encoded))
        flat = np.fromiter(itertools.chain.from_iterable(e.ids for e in encoded), dtype=np.int64,
                           count=int(lengths.sum()))
        ids = np.insert(flat, np.cumsum(lengths), eos)  # the end-of-text token after each document
        shards.add(ids)
        tokens += len(ids)
        docs += len(texts)
        progress(docs, tokens)

    held = 0
    for text in documents(files, field):
        if text:
            batch.append(text)
            held += len(text)
        if len(batch) == BATCH_DOCS or held >= BATCH_CHARS:
            encode(batch)
            batch, held = [], 0
    if batch:
        encode(batch)
    if docs == 0:
        raise DataError(f"the inputs ({', '.join(inputs)}) hold no text; give non-empty text or .jsonl files")
    shards.flush()
    return Prepared(shards.written, docs, tokens, kind, vocab, eos)
