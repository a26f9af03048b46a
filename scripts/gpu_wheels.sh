#!/usr/bin/env bash
# Wheels for a lent GPU machine whose Python lacks some of gputrain's dependencies, into .whl/ (git-ignored);
# scripts/gpu_check.sh installs whatever .whl/ holds into /tmp/site before it runs anything.
#
#   bash scripts/gpu_wheels.sh                  # Python 3.12, manylinux x86-64: the lent machines' image
#   PY_VERSION=3.11 bash scripts/gpu_wheels.sh  # another Python
#
# Which: the pinned versions (requirements.txt) of what the lent machines' image does not hold (its package list,
# 2026-11: python 3.12.3, torch 2.11.0, torchvision 0.26.0; no torchcodec, omegaconf or pycocotools). Each is a
# binary wheel without its dependencies, all of which that image has. TorchCodec 0.17 was built on torch 2.14's
# stable ABI: every torch symbol its image decoder and custom ops need is exported by torch 2.11's libraries
# (checked with nm), and `gpu_check.sh stack` proves the decode on the machine before the checks that need it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
PACKAGES=(torchcodec omegaconf pycocotools)
rm -rf .whl && mkdir .whl
for name in "${PACKAGES[@]}"; do
  pin=$(grep -i "^$name==" requirements.txt) || { echo "gpu_wheels.sh: $name is not pinned in requirements.txt" >&2; exit 2; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "$pin"
done
ls -l .whl
echo "carry .whl to the machine: bash scripts/gpu_check.sh installs it first"
