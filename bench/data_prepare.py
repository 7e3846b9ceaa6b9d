"""`hetspot data prepare` against the tokenizer's own batch encoding of the same text.

    python bench/data_prepare.py [--corpus ../shared/data/tinyshakespeare.txt] [--vocab 8192] [--repeats 5]

A byte-level BPE tokenizer of `--vocab` tokens is trained with `tokenizers` on the corpus; the corpus is cut into
documents at blank lines and written as one JSON-lines file. Then, alternating, `--repeats` times each:
  - prepare: workers/prepare.py end to end (load the tokenizer, read the .jsonl, encode in batches of up to
    8,192 documents, append the end-of-text token, write uint16 shards to a new folder);
  - encode_batch: `Tokenizer.encode_batch` over all the documents at once, in memory (what the tokenizer does
    with nothing around it: no reading, no writing);
  - encode_batch_fast: the same without character offsets (what prepare calls, where tokenizers has it).
Prints the median seconds and tokens/s of each and prepare's throughput against each baseline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"))
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from workers.prepare import prepare

    text = Path(args.corpus).read_text(encoding="utf-8")
    docs = [d for d in text.split("\n\n") if d.strip()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=["<|endoftext|>"]))
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        tok_path = tmp_path / "tokenizer.json"
        tok.save(str(tok_path))
        corpus = tmp_path / "corpus.jsonl"
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        runs: dict[str, list[float]] = {"prepare": [], "encode_batch": [], "encode_batch_fast": []}
        tokens = 0
        for r in range(args.repeats):
            t0 = time.perf_counter()
            got = prepare([str(corpus)], str(tok_path), str(tmp_path / f"out{r}"))
            runs["prepare"].append(time.perf_counter() - t0)
            tokens = got.tokens
            for name in ("encode_batch", "encode_batch_fast"):
                t0 = time.perf_counter()
                encoded = getattr(tok, name)(docs, add_special_tokens=False)
                runs[name].append(time.perf_counter() - t0)
                assert sum(len(e.ids) for e in encoded) + len(docs) == tokens
            print(f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in runs.items()), file=sys.stderr,
                  flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"corpus: {len(text):,} characters, {len(docs):,} documents, {tokens:,} tokens (vocabulary {args.vocab})")
    print(f"{'':18} {'median s':>9} {'tokens/s':>12}")
    for k in runs:
        print(f"{k:18} {med[k]:>9.3f} {tokens / med[k]:>12,.0f}")
    for k in ("encode_batch", "encode_batch_fast"):
        print(f"prepare / {k} throughput: {med[k] / med['prepare']:.2f}x")


if __name__ == "__main__":
    main()
