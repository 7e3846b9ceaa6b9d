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


def test_the_held_out_windows_are_never_trained_on(tmp_path):
    """data.val_fraction carves whole windows off the corpus's end: the training set's epochs are permutations of
    the other windows (as the workers make it, with or without an evaluation asked for), and the held-out set reads
    exactly the carved ones."""
    from workers.data import make_datasets

    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, n in enumerate((17 * 30 + 5, 17 * 20)):
        (np.arange(n, dtype=np.uint16) % 97 + i).tofile(folder / f"part-{i}.bin")
    data = {"kind": "tokens", "path": str(folder), "val_fraction": 0.2}
    train, held = make_datasets(data, 16, 100, seed=0, validation=True)
    alone, _ = make_datasets(data, 16, 100, seed=0)
    assert train.order.windows == alone.order.windows == 40 and held.samples == 10  # 50 windows, a fifth held out
    trained = {train.order.locate(g) for g in range(2 * 40)}  # two epochs
    carved = {train.order.locate_held(i) for i in range(10)}
    assert len(trained) == 40 and not trained & carved
    assert carved == {(1, o * 17) for o in range(10, 20)}  # the corpus's last ten windows
    assert [alone.order.locate(g) for g in range(40)] == [train.order.locate(g) for g in range(40)]


def test_a_corpus_is_opened_as_it_was_indexed_and_a_changed_shard_is_refused(tmp_path):
    """The workers open exactly the shards of the job's index: a file added to the folder later is not read (it
    would change every sample), and a shard rewritten after the index (same size, other tokens) or cut shorter is
    refused in one line naming it."""
    from workers.corpus_index import index_corpus
    from workers.data import make_datasets
    from workers.data_validation import DataError

    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(2):
        (np.arange(17 * 12, dtype=np.uint16) % 50 + i).tofile(folder / f"part-{i}.bin")
    data = {"kind": "tokens", "path": str(folder), "index": {"shards": index_corpus(str(folder))}}
    before = make_datasets(data, 16, 100)[0].batch(range(24)).numpy()
    (np.arange(17 * 5, dtype=np.uint16) % 50).tofile(folder / "part-2.bin")  # a shard added after the index
    again = make_datasets(data, 16, 100)[0]
    assert again.order.windows == 24 and np.array_equal(again.batch(range(24)).numpy(), before)
    tokens = np.fromfile(folder / "part-1.bin", dtype=np.uint16)
    tokens[-1] = 99  # one token of its last 4 KiB: the same size
    tokens.tofile(folder / "part-1.bin")
    with pytest.raises(DataError, match=r"shard '.*part-1\.bin' changed since the job was submitted \(version "):
        make_datasets(data, 16, 100)
    tokens[:-17].tofile(folder / "part-1.bin")
    with pytest.raises(DataError, match=r"part-1\.bin' changed since the job was submitted \(374 bytes, "
                                        r"indexed at 408"):
        make_datasets(data, 16, 100)
    (folder / "part-1.bin").unlink()
    with pytest.raises(DataError, match=r"part-1\.bin' cannot be read on this node"):
        make_datasets(data, 16, 100)
