"""Spot-notice pollers: read one node's cloud metadata service and say whether the node will be taken.

One function per cloud, each with a configurable base URL (the real services
live at 169.254.169.254 or metadata.google.internal; tests and drills point at
orchestrator/preemption/metadata_server.py):
  - AWS IMDSv2: a token from `PUT /latest/api/token`, then
    `spot/instance-action` (the two-minute notice, with its time) and
    `events/recommendations/rebalance` (an earlier warning, no deadline);
  - GCP: `instance/preempted` with `Metadata-Flavor: Google` (about 30 s left);
  - Azure Scheduled Events: a `Preempt` event, with `NotBefore` as the deadline.
Each returns a `CloudNotice` (source, deadline as a UNIX time) or None. Stdlib
HTTP only; every request has a short timeout, and an unreachable service means
no notice (logged once per poller, never raised into the training loop).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime

AWS_URL, GCP_URL, AZURE_URL = "http://169.254.169.254", "http://metadata.google.internal", "http://169.254.169.254"
GCP_NOTICE_S = 30.0  # GCP and Azure spot VMs get about 30 s
REBALANCE_NOTICE_S = 120.0  # a rebalance recommendation has no deadline: plan for the spot notice's two minutes
log = logging.getLogger("hetspot.notices")


@dataclass(frozen=True)
class CloudNotice:
    source: str  # "aws", "aws-rebalance", "gcp", "azure", "ray-drain"
    deadline_unix: float


def _get(url: str, headers: dict, timeout_s: float, method: str = "GET") -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def parse_aws_time(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def poll_aws(base: str = AWS_URL, timeout_s: float = 1.0) -> CloudNotice | None:
    code, token = _get(f"{base}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"}, timeout_s, "PUT")
    if code != 200:
        return None
    auth = {"X-aws-ec2-metadata-token": token}
    code, body = _get(f"{base}/latest/meta-data/spot/instance-action", auth, timeout_s)
    if code == 200 and body:
        return CloudNotice("aws", parse_aws_time(json.loads(body)["time"]))
    code, body = _get(f"{base}/latest/meta-data/events/recommendations/rebalance", auth, timeout_s)
    if code == 200 and body:
        return CloudNotice("aws-rebalance", time.time() + REBALANCE_NOTICE_S)
    return None


def poll_gcp(base: str = GCP_URL, timeout_s: float = 1.0) -> CloudNotice | None:
    code, body = _get(f"{base}/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"}, timeout_s)
    if code == 200 and body.strip().upper() == "TRUE":
        return CloudNotice("gcp", time.time() + GCP_NOTICE_S)
    return None


def poll_azure(base: str = AZURE_URL, timeout_s: float = 1.0) -> CloudNotice | None:
    code, body = _get(f"{base}/metadata/scheduledevents?api-version=2020-07-01", {"Metadata": "true"}, timeout_s)
    if code != 200 or not body:
        return None
    for ev in json.loads(body).get("Events", []):
        if ev.get("EventType") == "Preempt":
            not_before = ev.get("NotBefore")
            deadline = parsedate_to_datetime(not_before).timestamp() if not_before else time.time() + GCP_NOTICE_S
            return CloudNotice("azure", deadline)
    return None


POLLERS = {"aws": poll_aws, "gcp": poll_gcp, "azure": poll_azure}


def poll(cloud: str, base: str | None = None, timeout_s: float = 1.0) -> CloudNotice | None:
    """One poll of `cloud`'s service at `base` (its real address by default); None when there is no notice."""
    fn = POLLERS[cloud]
    try:
        return fn(base, timeout_s) if base else fn(timeout_s=timeout_s)
    except (OSError, ValueError, KeyError) as e:  # unreachable or malformed: no notice this time, and said so
        log.debug("polling %s at %s: %s", cloud, base, e)
        return None
