#!/bin/bash
# The wheels a lent GPU machine lacks for the benches, at this venv's versions, into .whl/
# (ignored), to travel with the device tool's `carry: [".whl"]`. Its image (2026-11) has torch
# 2.11 but an older transformers and huggingface_hub, and no opacus, pydantic, datasets or
# cryptography; a missing one costs a device call (it did on 2026-11-26: cryptography).
# On the device: bash bench/device_run.sh python3 bench/...
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS="transformers opacus pydantic pydantic_core annotated-types typing-inspection datasets dill multiprocess
      huggingface_hub httpx2 httpcore2 h2 hpack hyperframe truststore cryptography cffi pycparser sniffio"
pins=$(.venv/bin/python -c 'import sys; from importlib.metadata import version
print(" ".join(f"{p}=={version(p)}" for p in sys.argv[1:]))' $PKGS)
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl $pins
du -sh .whl
