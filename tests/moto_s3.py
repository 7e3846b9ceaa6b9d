"""moto's threaded S3 server on 127.0.0.1, reached by boto3 over HTTP, for the tests that need S3."""

import contextlib

import boto3

CREDS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


@contextlib.contextmanager
def moto_s3(*buckets: str):
    """Start the server, create `buckets`, yield its endpoint URL, stop it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        for b in buckets:
            boto3.client("s3", endpoint_url=url, **CREDS).create_bucket(Bucket=b)
        yield url
    finally:
        server.stop()
