"""IAM policies evaluated as AWS evaluates an identity policy, against the calls a role really makes.

moto checks only the action a request calls, not its resource, its conditions, or what the call implies (the
`iam:PassRole` of an instance profile, the `ec2:CreateTags` of a launch's tag specifications, the SSM lookup of a
`resolve:ssm:` image, the ECR reads of a `docker pull`). So: `Recorder` records every AWS API call made through
botocore in its block (every client, Ray's own included), `checks_of` turns each into the IAM checks AWS makes
for it (action, resource ARN, request context; the service authorization reference's tables for these actions),
and `allowed` decides one check against a policy: an explicit Deny wins, else some Allow statement whose
`Action`, `Resource` and `Condition` all match, else denied (AWS's policy evaluation logic for one identity
policy, with no resource policy, boundary or SCP in play). An operation that is not modelled here is an error,
so a new call cannot pass unchecked.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Check:
    action: str
    resource: str
    context: tuple[tuple[str, str], ...] = ()
    why: str = field(default="", compare=False)


def _list(x) -> list:
    return [x] if isinstance(x, str) else list(x)


def _glob(pattern: str, value: str, case: bool = True) -> bool:
    """IAM's wildcards: `*` any run of characters, `?` one."""
    rx = re.escape(pattern).replace(r"\*", ".*").replace(r"\?", ".")
    return re.fullmatch(rx, value, 0 if case else re.IGNORECASE) is not None


OPERATORS = {
    "StringEquals": lambda want, got: got == want,
    "StringNotEquals": lambda want, got: got != want,
    "StringLike": lambda want, got: _glob(want, got),
    "ArnEquals": lambda want, got: got == want,
    "ArnLike": lambda want, got: _glob(want, got),
    "Bool": lambda want, got: str(got).lower() == str(want).lower(),
}


def _conditions_hold(condition: dict, context: dict) -> bool:
    for op, pairs in condition.items():
        base, if_exists = op.removesuffix("IfExists"), op.endswith("IfExists")
        if base not in OPERATORS:
            raise ValueError(f"condition operator {op} is not modelled in tests/iam_policy.py")
        for key, wants in pairs.items():
            got = context.get(key)
            if got is None:
                if if_exists:
                    continue
                return False  # a condition on a key the request does not carry does not match
            if not any(OPERATORS[base](w, got) for w in _list(wants)):
                return False
    return True


def _matches(statement: dict, check: Check) -> bool:
    for key in ("NotAction", "NotResource", "Principal"):
        if key in statement:
            raise ValueError(f"{key} is not modelled in tests/iam_policy.py")
    if not any(_glob(a, check.action, case=False) for a in _list(statement["Action"])):
        return False
    if not any(_glob(r, check.resource) for r in _list(statement["Resource"])):
        return False
    return _conditions_hold(statement.get("Condition", {}), dict(check.context))


def allowed(policy: dict, check: Check) -> bool:
    hits = [s for s in policy["Statement"] if _matches(s, check)]
    if any(s["Effect"] == "Deny" for s in hits):
        return False
    return any(s["Effect"] == "Allow" for s in hits)


@dataclass
class Call:
    service: str  # the IAM prefix (botocore's signing name)
    operation: str
    params: dict
    region: str
    not_found: bool = False  # S3 answered 404


class Recorder:
    """Every AWS API call botocore makes inside `with recorder.recording():`, from any client."""

    def __init__(self):
        self.calls: list[Call] = []

    @contextlib.contextmanager
    def recording(self):
        from botocore.client import BaseClient

        original = BaseClient._make_api_call
        calls = self.calls

        def record(client, operation_name, api_params):
            from botocore.exceptions import ClientError

            model = client.meta.service_model
            call = Call(model.signing_name or model.endpoint_prefix, operation_name, dict(api_params),
                        client.meta.region_name)
            calls.append(call)
            try:
                return original(client, operation_name, api_params)
            except ClientError as e:
                call.not_found = str(e.response.get("Error", {}).get("Code")) in ("404", "NoSuchKey", "NotFound")
                raise

        BaseClient._make_api_call = record
        try:
            yield self
        finally:
            BaseClient._make_api_call = original

    @contextlib.contextmanager
    def aside(self):
        """Calls made here (by the test itself, as an administrator) are not the role's."""
        n = len(self.calls)
        try:
            yield
        finally:
            del self.calls[n:]


S3_BUCKET_ACTIONS = {"ListObjectsV2": "s3:ListBucket", "ListObjects": "s3:ListBucket", "HeadBucket": "s3:ListBucket",
                     "ListMultipartUploads": "s3:ListBucketMultipartUploads",
                     "ListObjectVersions": "s3:ListBucketVersions", "GetBucketVersioning": "s3:GetBucketVersioning"}
S3_OBJECT_ACTIONS = {"GetObject": "s3:GetObject", "HeadObject": "s3:GetObject", "PutObject": "s3:PutObject",
                     "CreateMultipartUpload": "s3:PutObject", "UploadPart": "s3:PutObject",
                     "CompleteMultipartUpload": "s3:PutObject", "AbortMultipartUpload": "s3:AbortMultipartUpload",
                     "DeleteObject": "s3:DeleteObject"}
VERSIONED = {"s3:GetObject": "s3:GetObjectVersion", "s3:DeleteObject": "s3:DeleteObjectVersion"}
EC2_ANY = {"DescribeInstances", "DescribeInstanceTypes", "DescribeSpotPriceHistory", "DescribeInstanceStatus"}
UNCHECKED = {("sts", "GetCallerIdentity")}  # needs no permission


def checks_of(call: Call, account: str, role_of_profile) -> list[Check]:
    """The IAM checks AWS makes for one call (`role_of_profile(name or ARN)`: the role an instance profile holds)."""
    s, op, p = call.service, call.operation, call.params
    why = f"{s}:{op}"
    if (s, op) in UNCHECKED:
        return []
    if s == "s3":
        bucket = p["Bucket"]
        if op in S3_BUCKET_ACTIONS:
            return [Check(S3_BUCKET_ACTIONS[op], f"arn:aws:s3:::{bucket}", why=why)]
        if op in S3_OBJECT_ACTIONS:
            action = S3_OBJECT_ACTIONS[op]
            action = VERSIONED.get(action, action) if p.get("VersionId") else action
            out = [Check(action, f"arn:aws:s3:::{bucket}/{p['Key']}", why=why)]
            if call.not_found:  # S3 answers a missing key 404 only to a caller that may list the bucket (else 403)
                out.append(Check("s3:ListBucket", f"arn:aws:s3:::{bucket}", why=f"{why}: a 404, not a 403"))
            return out
        if op == "DeleteObjects":
            return [Check("s3:DeleteObjectVersion" if o.get("VersionId") else "s3:DeleteObject",
                          f"arn:aws:s3:::{bucket}/{o['Key']}", why=why) for o in p["Delete"]["Objects"]]
    if s == "ec2":
        instance = f"arn:aws:ec2:{call.region}:{account}:instance/"
        if op in EC2_ANY:
            return [Check(f"ec2:{op}", "*", why=why)]
        if op == "RunInstances":
            out = [Check("ec2:RunInstances", instance + "*", why=why)]
            image = p["ImageId"]
            out.append(Check("ec2:RunInstances", f"arn:aws:ec2:{call.region}::image/{image}", why=why)
                       if not image.startswith("resolve:ssm:") else ssm_check(image, call.region, why))
            if p.get("TagSpecifications"):
                out.append(Check("ec2:CreateTags", instance + "*", (("ec2:CreateAction", "RunInstances"),),
                                 why=f"{why} (its TagSpecifications)"))
            profile = p.get("IamInstanceProfile")
            if profile:
                role = role_of_profile(profile.get("Name") or profile["Arn"])
                out.append(Check("iam:PassRole", f"arn:aws:iam::{account}:role/{role}",
                                 (("iam:PassedToService", "ec2.amazonaws.com"),),
                                 why=f"{why} (its IamInstanceProfile)"))
            return out
        if op == "CreateTags":
            return [Check("ec2:CreateTags", instance + r, why=why) for r in p["Resources"]]
        if op in ("TerminateInstances", "StartInstances", "StopInstances"):
            return [Check(f"ec2:{op}", instance + i, why=why) for i in p["InstanceIds"]]
    if s == "ecr":
        if op == "GetAuthorizationToken":
            return [Check("ecr:GetAuthorizationToken", "*", why=why)]
        if op in ("BatchGetImage", "GetDownloadUrlForLayer", "BatchCheckLayerAvailability"):
            return [Check(f"ecr:{op}", f"arn:aws:ecr:{call.region}:{account}:repository/{p['repositoryName']}",
                          why=why)]
    raise AssertionError(f"{s}:{op} is not modelled in tests/iam_policy.py: add the checks AWS makes for it")


def ssm_check(image_id: str, region: str, why: str) -> Check:
    """The SSM read EC2 makes with the caller's permissions for `ImageId: resolve:ssm:NAME` (AWS's public
    parameters have no account in their ARN)."""
    name = image_id.removeprefix("resolve:ssm:")
    return Check("ssm:GetParameters", f"arn:aws:ssm:{region}::parameter{name}", why=f"{why} (resolve:ssm:)")


def pull_checks(image: str) -> list[Check]:
    """What a `docker pull` of a private ECR image is authorized against (ECR's docs: the pull needs
    ecr:BatchGetImage and ecr:GetDownloadUrlForLayer on the repository; the client checks layers first)."""
    m = re.fullmatch(r"(\d{12})\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com/([^:@]+).*", image)
    assert m, image
    account, region, repo = m.groups()
    arn = f"arn:aws:ecr:{region}:{account}:repository/{repo}"
    return [Check(a, arn, why=f"docker pull {image}") for a in
            ("ecr:BatchCheckLayerAvailability", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer")]
