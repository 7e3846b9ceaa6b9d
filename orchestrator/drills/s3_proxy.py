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
    drops the client's connection without an answer, as a dead endpoint does.
It binds to 127.0.0.1 only. `counts` says how many requests it received (before any
delay), forwarded, throttled and dropped.
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

log = logging.getLogger("hetspot.drill")
SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message><RequestId>hetspot-drill</RequestId></Error>")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}


class S3FaultProxy:
    def __init__(self, target_url: str, port: int = 0):
        target = urlsplit(target_url)
        self.target = (target.hostname, target.port or 80)
        self.delay_s = 0.0
        self.slowdown_until = 0.0
        self.counts = {"received": 0, "forwarded": 0, "throttled": 0, "dropped": 0}
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
                body = self._body()
                proxy._count("received")
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
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                try:
                    conn = http.client.HTTPConnection(*proxy.target, timeout=60)
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                except OSError:  # the endpoint behind is down: so is this one, to the client
                    proxy._count("dropped")
                    self.close_connection = True
                    return
                proxy._count("forwarded")
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_BY_HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="s3-fault-proxy", daemon=True)
        self._thread.start()

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def slowdown(self, seconds: float) -> None:
        """Answer 503 SlowDown to every request for the next `seconds`."""
        self.slowdown_until = time.monotonic() + seconds
        log.warning("S3 answers 503 SlowDown for %.1f s", seconds)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
