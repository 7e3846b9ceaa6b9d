"""Spot-notice pollers against the project's fake metadata server over real HTTP (AWS IMDSv2, GCP, Azure)."""

import time
import urllib.request
from datetime import datetime, timedelta, timezone

import pytest

from orchestrator.preemption.metadata_server import FakeMetadataServer
from orchestrator.preemption.notices import poll, poll_aws

pytestmark = pytest.mark.unit


@pytest.fixture
def imds():
    server = FakeMetadataServer().start()
    yield server
    server.stop()


def test_no_notice_until_switched_on(imds):
    for cloud in ("aws", "gcp", "azure"):
        assert poll(cloud, imds.url) is None


def test_aws_spot_notice_uses_the_imdsv2_token_flow(imds):
    deadline = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(seconds=120)
    imds.aws_spot(deadline)
    got = poll_aws(imds.url)
    assert got.source == "aws" and got.deadline_unix == deadline.timestamp()
    # IMDSv2: without the token the path is refused, as on EC2
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(f"{imds.url}/latest/meta-data/spot/instance-action", timeout=2)


def test_aws_rebalance_is_an_early_notice(imds):
    imds.aws_rebalance()
    got = poll("aws", imds.url)
    assert got.source == "aws-rebalance" and 100 < got.deadline_unix - time.time() <= 120


def test_gcp_preempted(imds):
    imds.gcp_preempt()
    got = poll("gcp", imds.url)
    assert got.source == "gcp" and 25 < got.deadline_unix - time.time() <= 30


def test_azure_preempt_event(imds):
    not_before = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(seconds=30)
    imds.azure_preempt(not_before)
    got = poll("azure", imds.url)
    assert got.source == "azure" and got.deadline_unix == not_before.timestamp()


def test_unreachable_service_is_no_notice(monkeypatch):
    """No metadata service: no notice, after one request that gave up at the poll's timeout (no retries)."""
    from orchestrator.preemption import notices

    calls = []
    real = notices._get
    monkeypatch.setattr(notices, "_get", lambda url, headers, timeout_s, *a: calls.append(timeout_s) or
                        real(url, headers, timeout_s, *a))
    assert poll("aws", "http://127.0.0.1:9", timeout_s=0.5) is None
    assert calls == [0.5]


def test_a_gcp_notice_gets_the_platforms_grace_when_the_job_says_it():
    """GCP's notice carries no deadline: a GCE VM has about 30 s, a GKE spot pod 15 s (runtime.notice_grace_s,
    which the KubeRay render for GKE sets). AWS's own time is kept whatever the setting."""
    import time

    from orchestrator.preemption.notices import GCP_NOTICE_S
    from orchestrator.preemption.ray_notices import RayNotices

    class Clock:
        def now(self):
            return 100.0

    now = time.time()
    vm = RayNotices(None, clock=Clock())._to_notice("n", "gcp", now + GCP_NOTICE_S)
    gke = RayNotices(None, clock=Clock(), grace_s=15)._to_notice("n", "gcp", now + GCP_NOTICE_S)
    aws = RayNotices(None, clock=Clock(), grace_s=15)._to_notice("n", "aws", now + 120)
    assert abs(vm.deadline_s - 130) < 1 and abs(gke.deadline_s - 115) < 1 and abs(aws.deadline_s - 220) < 1
