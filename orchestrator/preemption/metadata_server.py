"""A fake cloud instance-metadata service for tests and drills (stdlib HTTP, no Ray, no boto3).

It speaks the three protocols hetspot's notice pollers read, closely enough to
exercise their real HTTP code (moto's IMDS answers 500 for these paths):
  - AWS IMDSv2: `PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds`
    returns a token; `GET /latest/meta-data/spot/instance-action` and
    `GET /latest/meta-data/events/recommendations/rebalance` need it in
    `X-aws-ec2-metadata-token` (401 without) and answer 404 until a notice is on;
    `GET /latest/meta-data/instance-id` and `.../instance-type` answer the node's own
    (what a node's start command reads for its labels);
  - GCP: `GET /computeMetadata/v1/instance/preempted` with `Metadata-Flavor: Google`
    answers `FALSE` or `TRUE`;
  - Azure Scheduled Events: `GET /metadata/scheduledevents?api-version=...` with
    `Metadata: true` answers `{"DocumentIncarnation": n, "Events": [...]}`.
A test switches a notice on with `aws_spot(deadline_utc)`, `aws_rebalance()`,
`gcp_preempt()` or `azure_preempt(deadline_utc)`; one server plays one node.
"""

from __future__ import annotations

import json
import secrets
import threading
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeMetadataServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, instance_id: str = "i-0fake0000000000001",
                 instance_type: str = "g6.12xlarge"):
        self.tokens: set[str] = set()
        self.instance = {"instance-id": instance_id, "instance-type": instance_type}
        self.spot_action: dict | None = None
        self.rebalance: dict | None = None
        self.gcp_preempted = False
        self.azure_events: list[dict] = []
        self.incarnation = 1
        self.requests = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet: tests read the state, not the log
                pass

            def do_PUT(self) -> None:
                server.requests += 1
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    token = secrets.token_hex(16)
                    server.tokens.add(token)
                    return self._send(200, token)
                self._send(400, "bad request")

            def do_GET(self) -> None:
                server.requests += 1
                path = self.path.split("?", 1)[0]
                if path.startswith("/latest/"):
                    if self.headers.get("X-aws-ec2-metadata-token") not in server.tokens:
                        return self._send(401, "")
                    name = path.removeprefix("/latest/meta-data/")
                    if name in server.instance:
                        return self._send(200, server.instance[name])
                    body = {"/latest/meta-data/spot/instance-action": server.spot_action,
                            "/latest/meta-data/events/recommendations/rebalance": server.rebalance}.get(path)
                    return self._send(200, json.dumps(body)) if body else self._send(404, "Not Found")
                if path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._send(403, "Missing Metadata-Flavor:Google header")
                    return self._send(200, "TRUE" if server.gcp_preempted else "FALSE")
                if path == "/metadata/scheduledevents":
                    if self.headers.get("Metadata") != "true":
                        return self._send(400, "Bad request: Metadata header")
                    return self._send(200, json.dumps({"DocumentIncarnation": server.incarnation,
                                                       "Events": server.azure_events}))
                self._send(404, "Not Found")

            def _send(self, code: int, body: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="fake-imds")

    def start(self) -> FakeMetadataServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- notices a test switches on ---------------------------------------------------
    def aws_spot(self, deadline: datetime, action: str = "terminate") -> None:
        self.spot_action = {"action": action, "time": iso(deadline)}

    def aws_rebalance(self, at: datetime | None = None) -> None:
        self.rebalance = {"noticeTime": iso(at or datetime.now(timezone.utc))}

    def gcp_preempt(self) -> None:
        self.gcp_preempted = True

    def azure_preempt(self, not_before: datetime) -> None:
        self.azure_events = [{"EventId": secrets.token_hex(8), "EventType": "Preempt", "ResourceType": "VirtualMachine",
                              "Resources": ["vm-0"], "EventStatus": "Scheduled", "NotBefore": not_before.strftime(
                                  "%a, %d %b %Y %H:%M:%S GMT"), "EventSource": "Platform", "DurationInSeconds": -1}]
        self.incarnation += 1
