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


def test_an_epoch_is_a_permutation_of_non_overlapping_windows_and_the_next_epoch_another():
    """workers/epochs.py: for corpora of 1 to 300 windows (and one of 100,003), an epoch's samples read every window
    exactly once; the next epoch reads them in another order; a window lies inside its shard, and a shard's tail
    short of a window is never read."""
    from workers.epochs import EpochOrder, Permutation

    for n in list(range(1, 301)) + [100_003]:
        p = Permutation(n, key=7)
        assert sorted(p(i) for i in range(n)) == list(range(n)), n
    order = EpochOrder([5 * 9 + 4, 3 * 9, 8], window=9, seed=3)  # 5, 3 and 0 windows; tails of 4 and 8 tokens
    assert order.windows == 8
    first = [order.window_of(g) for g in range(8)]
    second = [order.window_of(g) for g in range(8, 16)]
    assert sorted(first) == sorted(second) == list(range(8)) and first != second
    for g in range(16):
        shard, at = order.locate(g)
        assert shard in (0, 1) and at % 9 == 0 and at + 9 <= [49, 27][shard]
    assert order.epoch_of(15) == 1 and order.progress(12) == 1.5


def test_a_folder_of_shards_reads_like_one_file_of_their_windows(tmp_path):
    """A folder of token files is one corpus: each sample is a whole window of one shard, and over an epoch the
    samples are exactly the windows of all shards."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    shards = [np.arange(i * 1000, i * 1000 + n, dtype=np.uint16) % 997 for i, n in enumerate((170, 85, 40))]
    for i, a in enumerate(shards):
        a.tofile(folder / f"part-{i}.bin")
    (folder / ".hidden").write_bytes(b"\x00" * 10)
    k = TokenFile(str(folder), 16, vocab_size=1000)  # windows of 17: 10 + 5 + 2
    assert k.order.windows == 17
    rows = k.batch(range(17))
    want = sorted(tuple(int(x) for x in a[o:o + 17]) for a in shards for o in range(0, len(a) - 16, 17))
    assert sorted(tuple(r.tolist()) for r in rows) == want
