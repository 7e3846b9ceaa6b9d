"""Training data in S3: a flat token (or byte) file read in place, one ranged GET per window a rank trains.

`data: {kind: tokens, path: s3://BUCKET/KEY}` (or `kind: text`) makes each worker
read exactly the byte ranges of the samples its replica trains (`Range:
bytes=a-b`), so nothing is copied to the nodes first and the sample-index
semantics are those of a local file: the same index gives the same window. The
client is boto3's, with its standard credentials chain (environment, profile,
instance role, IRSA) and endpoint (`data.endpoint_url`, else AWS_ENDPOINT_URL,
else AWS), and the standard retry mode, as the checkpoints use. `S3Array` is a
read-only numpy-like view (`len`, `[a:b]`) that the windowed datasets and the
up-front checks (workers/data_validation.py) slice like a memory-mapped file.
"""

from __future__ import annotations

import os
import re
import threading

import numpy as np

from workers.data_errors import DataError

_URI = re.compile(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])/(.+)")


def is_s3(path: str | None) -> bool:
    return bool(path) and path.startswith("s3://")


class S3Array:
    """An S3 object as a 1-D array of `dtype`, read by ranged GETs; `bytes_read` counts what came over."""

    def __init__(self, uri: str, dtype: str, endpoint_url: str | None = None, client=None):
        m = _URI.fullmatch(uri)
        if not m:
            raise DataError(f"data.path {uri!r} must look like s3://BUCKET/KEY (a bucket name of 3-63 lowercase "
                            "letters, digits, dots or dashes, then the object's key)")
        self.uri, self.bucket, self.key, self.dtype = uri, m.group(1), m.group(2), np.dtype(dtype)
        self.client = client or new_s3_client(endpoint_url)  # boto3 clients are safe to share between threads
        self.size_bytes = self._head(endpoint_url)
        self.bytes_read = 0
        self.requests = 0
        self._count = threading.Lock()

    def _head(self, endpoint_url: str | None) -> int:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self.key)["ContentLength"])
        except NoCredentialsError:
            raise DataError(f"data.path {self.uri!r}: no AWS credentials were found (boto3 looks at the environment, "
                            "~/.aws profiles and the instance role); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                            "or AWS_PROFILE") from None
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code"))
            if code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket"):
                raise DataError(f"data.path {self.uri!r} does not exist at {endpoint_url or 'AWS'}; check the bucket "
                                "and key (`aws s3 ls`)") from None
            if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise DataError(f"data.path {self.uri!r}: access was refused ({code}); give the job's credentials "
                                "s3:GetObject on it (the nodes' instance profile, IRSA, or keys)") from None
            raise DataError(f"data.path {self.uri!r}: S3 answered {code}") from None
        except BotoCoreError as e:
            raise DataError(f"data.path {self.uri!r}: cannot reach S3 ({e}); check data.endpoint_url") from None

    def __len__(self) -> int:
        return self.size_bytes // self.dtype.itemsize

    def __getitem__(self, sl: slice) -> np.ndarray:
        if not isinstance(sl, slice):
            raise TypeError("an S3Array is read by slices: a[start:stop]")
        start, stop, step = sl.indices(len(self))
        if step != 1:
            raise TypeError("an S3Array is read by contiguous slices")
        if stop <= start:
            return np.empty(0, dtype=self.dtype)
        first, last = start * self.dtype.itemsize, stop * self.dtype.itemsize - 1
        body = self.client.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={first}-{last}")["Body"].read()
        with self._count:
            self.bytes_read += len(body)
            self.requests += 1
        return np.frombuffer(body, dtype=self.dtype)


RETRIES = {"mode": "standard", "max_attempts": 8}  # 503 SlowDown and throttling back off with jitter


def new_s3_client(endpoint_url: str | None = None, config=None):
    """An S3 client from a fresh boto3 session (credentials are looked up now: boto3's default session would
    keep the first ones it found for the life of the process), with the standard retry mode; `config` (a
    botocore Config) is merged over it. The checkpoints (orchestrator/state/s3_store.py) use it too."""
    import boto3
    from botocore.config import Config

    attempts = os.environ.get("AWS_MAX_ATTEMPTS")  # botocore's own knob: a user (or a test) may lower it
    retries = Config(retries=RETRIES | ({"max_attempts": int(attempts)} if attempts and attempts.isdigit() else {}))
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url,
                                          config=retries if config is None else retries.merge(config))
