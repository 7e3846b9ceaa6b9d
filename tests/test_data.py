"""Datasets depend only on the global sample index: any plan, any resume point, same samples."""

import numpy as np
import pytest
import torch

from workers.data import SyntheticCorpus, TextFile, TokenFile, make_dataset

pytestmark = pytest.mark.unit


def test_synthetic_is_index_deterministic_and_learnable():
    d = SyntheticCorpus(64, 16, seed=3)
    whole = d.batch(range(10, 18))
    parts = torch.cat([d.batch(range(10, 13)), d.batch(range(13, 18))])
    assert torch.equal(whole, parts)
    diffs = (whole[:, 1:] - whole[:, :-1]) % 64
    assert (diffs == diffs[:, :1]).all()  # one stride per sample: predictable from context


def test_text_and_token_files(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(b"hello hetspot, " * 20)
    t = TextFile(str(text), 8, seed=1)
    assert t.vocab_size == 256 and t.batch(range(4)).shape == (4, 9)
    assert torch.equal(t.batch(range(2, 4)), t.batch(range(4))[2:])
    toks = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint16).tofile(toks)
    k = TokenFile(str(toks), 16, vocab_size=1000)
    row = k.batch(range(1))[0]
    assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 17))  # a contiguous window
    with pytest.raises(ValueError, match="vocab_size >= 256"):
        make_dataset("text", 8, 64, path=str(text))
    small = tmp_path / "s.bin"
    np.arange(5, dtype=np.uint32).tofile(small)
    with pytest.raises(ValueError, match="need at least"):
        TokenFile(str(small), 16, 100, dtype="uint32")
