"""Train a small byte-level BPE tokenizer for the demo (`make demo`): `python examples/make_tokenizer.py OUT.json
TEXT...`. A real run uses its model's own tokenizer.json (a Hugging Face model folder has one); this one exists so
that the demo's `hetspot data prepare` step needs nothing downloaded."""

import sys
from pathlib import Path


def main(out: str, inputs: list[str], vocab_size: int = 1024) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((Path(p).read_text() for p in inputs), trainer)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tok.save(out)
    print(f"tokenizer: {out} ({tok.get_vocab_size()} tokens, trained on {len(inputs)} files)")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python examples/make_tokenizer.py OUT.json TEXT...")
    main(sys.argv[1], sys.argv[2:])
