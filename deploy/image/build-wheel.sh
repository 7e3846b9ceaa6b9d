#!/bin/sh
# Build hetspot's wheel from a source tree the builder may not write to (the Dockerfile's root-owned COPY, built
# as Ray's non-root user): the tree is copied to a fresh folder first, so setuptools' build/ and *.egg-info never
# land in it. Usage: build-wheel.sh SOURCE_TREE WHEEL_FOLDER
set -eu
src=${1:?usage: build-wheel.sh SOURCE_TREE WHEEL_FOLDER}
out=${2:?usage: build-wheel.sh SOURCE_TREE WHEEL_FOLDER}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -R "$src"/. "$work"/
mkdir -p "$out"
"${PYTHON:-python3}" -m pip wheel --no-cache-dir --no-deps --wheel-dir "$out" "$work"
