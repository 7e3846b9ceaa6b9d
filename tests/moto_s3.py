"""moto's threaded server on 127.0.0.1, reached by boto3 over HTTP, for the tests that need S3, EC2 or IAM."""

import contextlib
import os

import boto3

CREDS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
# The same as environment variables, for hetspot's processes (the nodes' keepers and workers take credentials
# from their environment, as nodes with an instance role would; moto accepts any).
TEST_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true"}


def use_test_credentials() -> None:
    """Put TEST_ENV in this process's environment where nothing is set (Ray nodes started later inherit it)."""
    for k, v in TEST_ENV.items():
        os.environ.setdefault(k, v)


@contextlib.contextmanager
def moto_server():
    """moto's server for every AWS service it fakes (S3, EC2, IAM), on a free port: yield its endpoint URL,
    stop it."""
    import requests
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    # moto keeps its accounts in the process: a server starts and ends empty, so an IAM user or role one module
    # made is not there when the next module (in the same test worker) makes it
    requests.post(f"{url}/moto-api/reset", timeout=30)
    try:
        yield url
    finally:
        requests.post(f"{url}/moto-api/reset", timeout=30)
        server.stop()


@contextlib.contextmanager
def moto_s3(*buckets: str):
    """Start the server, create `buckets`, yield its endpoint URL, stop it."""
    with moto_server() as url:
        for b in buckets:
            boto3.client("s3", endpoint_url=url, **CREDS).create_bucket(Bucket=b)
        yield url

