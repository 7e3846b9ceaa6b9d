"""S3 training data through the node's block cache (data at GPU speed): windows come from cached blocks
of the object and equal the local file's; windows in one block cost one GET between them, whatever the threads; a
second process on the node (a replacement worker) reads the blocks its predecessor fetched with no request; the
folder stays within its bound; and a cache never serves another version of the object. moto's server over HTTP."""

import threading

import boto3
import numpy as np
import pytest
import torch

from tests.moto_s3 import CREDS, moto_s3, use_test_credentials
from workers.data_errors import DataError

pytestmark = pytest.mark.unit
SEQ, VOCAB = 31, 256
TOKENS = np.random.default_rng(5).integers(0, VOCAB, 64_000, dtype=np.uint16)  # 128,000 bytes
BLOCK = 16_000  # bytes: 8 blocks


@pytest.fixture(scope="module")
def s3():
    use_test_credentials()
    with moto_s3("data") as url:
        c = boto3.client("s3", endpoint_url=url, **CREDS)
        c.put_object(Bucket="data", Key="tokens.bin", Body=TOKENS.tobytes())
        yield url, c


def _cached(url: str, root, max_bytes: int = 1 << 30, key: str = "tokens.bin", seed: int = 1):
    from workers.data import TokenFile
    from workers.s3_data import CacheConfig

    return TokenFile(f"s3://data/{key}", SEQ, VOCAB, seed=seed, endpoint_url=url,
                     cache=CacheConfig(max_bytes, BLOCK, str(root)))


def _local(tmp_path, seed: int = 1):
    from workers.data import TokenFile

    path = tmp_path / "tokens.bin"
    TOKENS.tofile(path)
    return TokenFile(str(path), SEQ, VOCAB, seed=seed)


def test_windows_come_from_cached_blocks_and_a_second_process_reads_them_with_no_request(s3, tmp_path):
    url, _ = s3
    first, local = _cached(url, tmp_path / "cache"), _local(tmp_path)
    rows = [range(0, 40), range(40, 100), range(100, 101)]
    for r in rows:
        assert torch.equal(first.batch(r), local.batch(r))
    arr = first.tokens
    # 101 windows over 8 blocks: at most one GET a block (the windows in a block share it), each a whole block
    assert arr.requests <= 8 and arr.requests == arr.blocks.misses
    assert arr.bytes_read == sum(min(BLOCK, TOKENS.nbytes - b * BLOCK) for b in range(arr.requests))
    again = _cached(url, tmp_path / "cache")  # another worker process on the node: the same folder
    for r in rows:
        assert torch.equal(again.batch(r), local.batch(r))
    assert again.tokens.requests == 0 and again.tokens.blocks.hits > 0


def test_threads_asking_for_one_block_share_one_get(s3, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    url, _ = s3
    data = _cached(url, tmp_path / "cache")
    arr = data.tokens
    barrier = threading.Barrier(16)

    def window(i):
        barrier.wait()
        return arr[i * 10:i * 10 + 32]  # 16 windows in the first block, asked at once

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(window, range(16)))
    for i, w in enumerate(got):
        assert np.array_equal(w, TOKENS[i * 10:i * 10 + 32])
    assert arr.requests == 1


def test_the_cache_stays_within_its_bound_and_still_gives_the_files_windows(s3, tmp_path):
    url, _ = s3
    root = tmp_path / "cache"
    data, local = _cached(url, root, max_bytes=2 * BLOCK), _local(tmp_path)
    for start in range(0, 400, 20):
        r = range(start, start + 20)
        assert torch.equal(data.batch(r), local.batch(r))
        assert sum(p.stat().st_size for p in root.glob("*/*.blk")) <= 2 * BLOCK
    assert data.tokens.requests > 8  # blocks went and were read again: the bound is real


def test_a_cache_never_serves_another_version_of_the_object(s3, tmp_path):
    url, c = s3
    c.put_object(Bucket="data", Key="v.bin", Body=TOKENS.tobytes())
    root = tmp_path / "cache"
    old = _cached(url, root, key="v.bin")
    w = old.tokens[0:32]  # block 0 of the first version is cached
    changed = (TOKENS + 1).astype(np.uint16)
    c.put_object(Bucket="data", Key="v.bin", Body=changed.tobytes())
    assert np.array_equal(old.tokens[0:32], w)  # a cached block of the version the job opened
    with pytest.raises(DataError, match=r"data.path 's3://data/v.bin' changed while the job read it"):
        old.tokens[50_000:50_032]  # a block it had not read: S3 refuses the old ETag
    new = _cached(url, root, key="v.bin")  # a job started now opens the new version: none of the old blocks
    assert np.array_equal(new.tokens[0:32], changed[0:32]) and new.tokens.requests == 1


def test_the_job_files_cache_settings_reach_the_dataset(s3, tmp_path):
    from orchestrator.job_spec import DataSpec
    from workers.s3_data import CacheConfig

    spec = DataSpec(kind="tokens", path="s3://data/tokens.bin", cache_gb=0.5, block_mib=2, cache_dir=str(tmp_path))
    cfg = CacheConfig.from_data(spec.model_dump())
    assert (cfg.max_bytes, cfg.block_bytes, cfg.root) == (2**29, 2 * 2**20, tmp_path)
    assert CacheConfig.from_data(DataSpec(kind="tokens", path="s3://data/t.bin", cache_gb=0).model_dump()) is None
    assert DataSpec(kind="tokens", path="s3://data/t.bin").cache_gb == 4.0  # on by default


def test_a_shard_changed_while_the_job_reads_is_refused_naming_it(s3, tmp_path):
    """A corpus of shards under an s3:// prefix: each shard is opened at its ETag, so one written again while the
    job reads is refused in one line naming that shard, never mixed with the version the job started on."""
    c = s3[1]
    for name, part in (("a.bin", TOKENS[:30_000]), ("b.bin", TOKENS[30_000:])):
        c.put_object(Bucket="data", Key=f"sharded/{name}", Body=part.tobytes())
    data = _cached(s3[0], tmp_path / "cache", key="sharded/")
    assert len(data.shards) == 2
    data.shards[1][0:32]  # the first block of shard b is cached
    c.put_object(Bucket="data", Key="sharded/b.bin", Body=(TOKENS[30_000:] + 1).astype(np.uint16).tobytes())
    with pytest.raises(DataError, match=r"data.path 's3://data/sharded/b.bin' changed while the job read it"):
        data.shards[1][30_000:30_032]
