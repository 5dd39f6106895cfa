#!/bin/bash
# On a lent GPU machine, from the repository root: install the wheels bench/device_wheels.sh
# fetched (carried as .whl) beside the image's torch, then run the command given, e.g.
#   bash bench/device_run.sh python3 bench/bk_bf16_factors.py --device cuda
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
exec "$@"
