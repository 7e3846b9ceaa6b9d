"""`python -m orchestrator.cluster.node_labels`: the `--labels=...` argument a cloud node's `ray start` adds for
itself, read from its instance metadata service (EC2's IMDSv2): `hetspot/instance-id`, `hetspot/instance-type`
and `hetspot/node` (the instance id). The AWS cluster config runs it inside the node image (hetspot is installed
there), so no shell tool beyond Python is needed on the node. Stdlib only; exits 1 with a one-line reason when
the service does not answer (the node then starts without those labels, as a node off EC2 would).
"""

from __future__ import annotations

import sys
import urllib.request

from orchestrator.cluster.labels import LABEL_INSTANCE_ID, LABEL_INSTANCE_TYPE, LABEL_NODE

IMDS = "http://169.254.169.254"


def ec2_identity(base: str = IMDS, timeout_s: float = 2.0) -> tuple[str, str]:
    """(instance id, instance type) from EC2's IMDSv2 at `base`."""
    token_req = urllib.request.Request(f"{base}/latest/api/token", method="PUT",
                                       headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"})
    with urllib.request.urlopen(token_req, timeout=timeout_s) as r:
        token = r.read().decode()

    def get(name: str) -> str:
        req = urllib.request.Request(f"{base}/latest/meta-data/{name}", headers={"X-aws-ec2-metadata-token": token})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.read().decode().strip()

    return get("instance-id"), get("instance-type")


def labels_argument(instance_id: str, instance_type: str) -> str:
    return (f"--labels={LABEL_INSTANCE_ID}={instance_id},{LABEL_INSTANCE_TYPE}={instance_type},"
            f"{LABEL_NODE}={instance_id}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    base = argv[0] if argv else IMDS
    try:
        print(labels_argument(*ec2_identity(base)))
    except OSError as e:
        print(f"node_labels: the instance metadata service at {base} did not answer ({e})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
