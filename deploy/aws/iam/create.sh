#!/bin/sh
# Create the two roles and instance profiles the AWS cluster config names (orchestrator/deploy/render.py):
#   hetspot-head: Ray's autoscaler on the head starts, tags, lists and stops the workers, passes the node role to
#                 them (that role only), resolves the GPU AMI's public SSM parameter, and uses the bucket;
#   hetspot-node: the workers' keepers and data readers use the bucket, and nothing else.
# Usage: deploy/aws/iam/create.sh BUCKET   (with credentials that may create IAM roles; run once per account)
set -eu
bucket=${1:?usage: create.sh BUCKET}
here=$(dirname "$0")
account=$(aws sts get-caller-identity --query Account --output text)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for role in head node; do
  sed -e "s/ACCOUNT_ID/$account/g" -e "s/BUCKET/$bucket/g" "$here/$role-policy.json" > "$tmp/$role.json"
  aws iam create-role --role-name "hetspot-$role" --assume-role-policy-document "file://$here/ec2-trust.json"
  aws iam put-role-policy --role-name "hetspot-$role" --policy-name hetspot --policy-document "file://$tmp/$role.json"
  aws iam create-instance-profile --instance-profile-name "hetspot-$role"
  aws iam add-role-to-instance-profile --instance-profile-name "hetspot-$role" --role-name "hetspot-$role"
done
echo "created hetspot-head and hetspot-node (roles and instance profiles) for s3://$bucket in account $account"
