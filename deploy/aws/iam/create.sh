#!/bin/sh
# What an empty AWS account needs before `ray up` (orchestrator/deploy/render.py names these roles and profiles):
#   AWSServiceRoleForEC2Spot: EC2's service-linked role for spot; an account that never used spot has none and
#                 refuses every spot request until it exists (creating it needs iam:CreateServiceLinkedRole);
#   hetspot-head: Ray's autoscaler on the head launches, tags, lists and terminates the workers, passes the node
#                 role to EC2 (that role only), resolves the GPU AMI's public SSM parameter, reads spot prices
#                 (`hetspot inventory --ec2-region`), pulls the node image, and uses the buckets;
#   hetspot-node: the workers pull the node image from ECR and use the checkpoint bucket and read the data bucket,
#                 nothing else.
# Usage: deploy/aws/iam/create.sh BUCKET [DATA_BUCKET] [REPOSITORY]
#   BUCKET: the checkpoint bucket; DATA_BUCKET: where the training data is (default: BUCKET); REPOSITORY: the ECR
#   repository of the node image (default: hetspot-node). Run it with credentials that may create IAM roles (an
#   administrator, once per account). Running it again changes nothing that is already there, and puts the
#   policies as they are in these files.
set -eu
usage="usage: create.sh BUCKET [DATA_BUCKET] [REPOSITORY]"
bucket=${1:?$usage}
data=${2:-$bucket}
repo=${3:-hetspot-node}
here=$(dirname "$0")
account=$(aws sts get-caller-identity --query Account --output text)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# (found by its path, which names the service: the role's own name is AWS's to choose)
spot=$(aws iam list-roles --path-prefix /aws-service-role/spot.amazonaws.com/ --query 'Roles[0].RoleName' \
  --output text)
if [ -n "$spot" ] && [ "$spot" != "None" ]; then
  echo "AWSServiceRoleForEC2Spot: already there ($spot)"
else
  aws iam create-service-linked-role --aws-service-name spot.amazonaws.com >/dev/null
  echo "AWSServiceRoleForEC2Spot: created"
fi
for role in head node; do
  sed -e "s/ACCOUNT_ID/$account/g" -e "s/DATA_BUCKET/$data/g" -e "s/BUCKET/$bucket/g" -e "s/REPOSITORY/$repo/g" \
    "$here/$role-policy.json" > "$tmp/$role.json"
  if ! aws iam get-role --role-name "hetspot-$role" >/dev/null 2>&1; then
    aws iam create-role --role-name "hetspot-$role" --assume-role-policy-document "file://$here/ec2-trust.json" \
      >/dev/null
  fi
  aws iam put-role-policy --role-name "hetspot-$role" --policy-name hetspot --policy-document "file://$tmp/$role.json"
  if ! aws iam get-instance-profile --instance-profile-name "hetspot-$role" >/dev/null 2>&1; then
    aws iam create-instance-profile --instance-profile-name "hetspot-$role" >/dev/null
    aws iam add-role-to-instance-profile --instance-profile-name "hetspot-$role" --role-name "hetspot-$role"
  fi
  echo "hetspot-$role: role, policy and instance profile in place"
done
echo "done: s3://$bucket (checkpoints), s3://$data (data), ECR repository $repo, account $account"
