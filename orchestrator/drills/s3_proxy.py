"""`S3FaultProxy`: an HTTP proxy in front of an S3 endpoint that a drill or a test can make slow or throttled.

Real buckets answer `503 SlowDown` under load and some sit far away; moto does
neither. The proxy forwards every request unchanged (method, path, headers,
body: SigV4 signatures stay valid because the Host header is passed as sent)
and, while told to:
  - `delay_s`: holds each request this long first (a slow or distant bucket);
  - `slowdown(for_s)`: answers every request with S3's own `503 SlowDown` error
    document for `for_s` seconds (botocore's standard retry mode backs off and
    retries it);
  - when the endpoint behind it is down (the `s3-outage` fault stops moto), it
    drops the client's connection without an answer, as a dead endpoint does;
  - `fail(...)`: answers requests that match (method, key, query) with an S3 error
    (AccessDenied, SlowDown, InternalError...) instead of forwarding them: a bucket
    policy that denies, a prefix throttled past the retries;
  - `fail_after_commit(...)`: forwards a matching request, then answers 500 in place
    of S3's answer (the write happened; its answer was lost, as real S3 does under load);
  - `refuse_deletes(...)`: answers DeleteObjects with 200 and a per-key error entry for
    the matching keys, deleting only the others (what S3 does under a deny-delete policy
    or load);
  - `conn_bytes_per_s`: carries each connection's bodies (answers and uploads) at most this
    fast, as one TCP stream to S3 is bounded while many streams add up (bench/s3_restore.py).
It binds to 127.0.0.1 only. `counts` says how many requests it received (before any
delay), forwarded, throttled and dropped.
"""

from __future__ import annotations

import http.client
import logging
import re
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit
from xml.etree import ElementTree
from xml.sax.saxutils import escape

log = logging.getLogger("hetspot.drill")
SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message><RequestId>hetspot-drill</RequestId></Error>")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}
STATUS = {"AccessDenied": 403, "SlowDown": 503, "InternalError": 500, "NoSuchKey": 404, "ServiceUnavailable": 503}


def error_document(code: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{code} (hetspot fault '
            f'proxy)</Message><RequestId>hetspot-proxy</RequestId></Error>').encode()


@dataclass
class ProxyFault:
    """Requests whose method, key (the path after the bucket) and query match get `kind`: "error" (answered with
    S3's `code`, not forwarded), "after-commit" (forwarded, then answered 500) or "delete" (their keys refused
    inside a DeleteObjects answer). `times`: how many requests it takes (None: every one)."""

    kind: str
    method: str | None = None
    key: str = ""
    query: str = ""
    code: str = "AccessDenied"
    times: int | None = None
    taken: int = 0

    def matches(self, method: str, key: str, query: str) -> bool:
        return ((self.method is None or self.method == method) and re.search(self.key, key) is not None
                and re.search(self.query, query) is not None and (self.times is None or self.taken < self.times))


class S3FaultProxy:
    def __init__(self, target_url: str, port: int = 0):
        target = urlsplit(target_url)
        self.target = (target.hostname, target.port or 80)
        self.delay_s = 0.0
        self.conn_bytes_per_s: float | None = None  # each connection's bodies, at most this fast
        self.slowdown_until = 0.0
        self.gate: threading.Event | None = None  # when set to an Event, requests wait until it is set
        self.in_flight = 0  # requests received and not yet answered
        self.counts = {"received": 0, "forwarded": 0, "throttled": 0, "dropped": 0, "faulted": 0}
        self.faults: list[ProxyFault] = []
        self._client = None
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # one line per request is noise in a drill's output
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            self.rfile.readline()
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                with proxy._lock:
                    proxy.in_flight += 1
                try:
                    self._handle_one()
                finally:
                    with proxy._lock:
                        proxy.in_flight -= 1

            def _handle_one(self) -> None:
                t0 = time.monotonic()
                body = self._body()
                proxy._count("received")
                if proxy.conn_bytes_per_s and body:  # the upload's bytes came over this one connection
                    time.sleep(max(0.0, len(body) / proxy.conn_bytes_per_s - (time.monotonic() - t0)))
                gate = proxy.gate
                if gate is not None:
                    gate.wait(60)
                if proxy.delay_s:
                    time.sleep(proxy.delay_s)
                if time.monotonic() < proxy.slowdown_until:
                    proxy._count("throttled")
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOWDOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(SLOWDOWN)
                    return
                path, _, query = self.path.partition("?")
                bucket, _, key = unquote(path.lstrip("/")).partition("/")
                fault = proxy._take(self.command, key, query)
                if fault is not None and fault.kind == "error":
                    self._answer(STATUS.get(fault.code, 400), error_document(fault.code))
                    return
                if fault is not None and fault.kind == "delete":
                    self._answer(200, proxy._delete_some(bucket, body, fault))
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                try:
                    status, resp_headers, data = proxy._forward(self.command, self.path, body, headers)
                except OSError:  # the endpoint behind is down: so is this one, to the client
                    proxy._count("dropped")
                    self.close_connection = True
                    return
                proxy._count("forwarded")
                if fault is not None:  # "after-commit": S3 did it; the client hears 500
                    self._answer(500, error_document("InternalError"))
                    return
                self.send_response(status)
                length = str(len(data))
                for k, v in resp_headers:
                    if k.lower() == "content-length" and self.command == "HEAD":
                        length = v  # a HEAD's answer has no body: its length is the object's
                    elif k.lower() not in HOP_BY_HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self._paced(data)

            def _paced(self, data: bytes) -> None:
                rate = proxy.conn_bytes_per_s
                if not rate:
                    self.wfile.write(data)
                    return
                t0, chunk = time.monotonic(), max(16 << 10, int(rate / 50))  # ~20 ms of the connection's rate
                for at in range(0, len(data), chunk):
                    self.wfile.write(data[at:at + chunk])
                    ahead = (at + chunk) / rate - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)

            def _answer(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="s3-fault-proxy", daemon=True)
        self._thread.start()

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def _forward(self, method: str, path: str, body: bytes, headers: dict) -> tuple[int, list, bytes]:
        conn = http.client.HTTPConnection(*self.target, timeout=60)
        try:
            conn.request(method, path, body=body or None, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.getheaders(), resp.read()
        finally:
            conn.close()

    def _take(self, method: str, key: str, query: str) -> ProxyFault | None:
        with self._lock:
            for f in self.faults:
                if f.kind == "delete":  # its key regex is applied to each key inside the request
                    hit = method == "POST" and "delete" in query.split("&") and (f.times is None or f.taken < f.times)
                else:
                    hit = f.matches(method, key, query)
                if hit:
                    f.taken += 1
                    self.counts["faulted"] += 1
                    return f
        return None

    def _delete_some(self, bucket: str, body: bytes, fault: ProxyFault) -> bytes:
        """A DeleteObjects answer: the keys matching `fault.key` refused with its code, the others deleted behind."""
        keys = [e.text or "" for e in ElementTree.fromstring(body).iter() if e.tag.endswith("Key")]
        rows = []
        for k in keys:
            if re.search(fault.key, k):
                rows.append(f"<Error><Key>{escape(k)}</Key><Code>{fault.code}</Code><Message>{fault.code} "
                            "(hetspot fault proxy)</Message></Error>")
                continue
            self._backend().delete_object(Bucket=bucket, Key=k)
            rows.append(f"<Deleted><Key>{escape(k)}</Key></Deleted>")
        return ('<?xml version="1.0" encoding="UTF-8"?>\n<DeleteResult xmlns="http://s3.amazonaws.com/doc/'
                f'2006-03-01/">{"".join(rows)}</DeleteResult>').encode()

    def _backend(self):
        """A client of the endpoint behind (moto takes any credentials; a real endpoint, the environment's)."""
        if self._client is None:
            import boto3

            session = boto3.session.Session()
            creds = ({} if session.get_credentials()
                     else {"aws_access_key_id": "proxy", "aws_secret_access_key": "proxy"})
            self._client = session.client("s3", endpoint_url=f"http://{self.target[0]}:{self.target[1]}",
                                          region_name="us-east-1", **creds)
        return self._client

    def fail(self, method: str | None = None, key: str = "", code: str = "AccessDenied", query: str = "",
             times: int | None = None) -> ProxyFault:
        """Answer matching requests (key: a regex on the object key; "" matches all) with S3's error `code`."""
        return self._add(ProxyFault("error", method, key, query, code, times))

    def fail_after_commit(self, method: str = "PUT", key: str = "", times: int | None = 1) -> ProxyFault:
        """Forward matching requests, then answer 500 InternalError: the write is in, the client does not know."""
        return self._add(ProxyFault("after-commit", method, key, "", "InternalError", times))

    def refuse_deletes(self, key: str = "", code: str = "AccessDenied", times: int | None = None) -> ProxyFault:
        """DeleteObjects answers 200 with a per-key `code` error for the keys matching `key`, and deletes the rest."""
        return self._add(ProxyFault("delete", "POST", key, "delete", code, times))

    def _add(self, fault: ProxyFault) -> ProxyFault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Stop every `fail`, `fail_after_commit` and `refuse_deletes`."""
        with self._lock:
            self.faults.clear()

    def slowdown(self, seconds: float) -> None:
        """Answer 503 SlowDown to every request for the next `seconds`."""
        self.slowdown_until = time.monotonic() + seconds
        log.warning("S3 answers 503 SlowDown for %.1f s", seconds)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
