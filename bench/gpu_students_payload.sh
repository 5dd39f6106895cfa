#!/bin/bash
# The payload of bench/gpu_students.py, packed here into .dev/c1 .. .dev/cN (ignored), one per
# device call: a call carries the working tree (~20 MB) and at most 64 MiB in all, and the GPU
# machine fetches nothing, so the teacher travels in bf16 and xz (270 -> 146 MB) across calls
# to one warm machine (30 s idle between calls). In it, in order: the wheels the image lacks
# (bench/device_wheels.sh), the teacher's small files, WikiText-2's test text, the first
# ELTEC_BYTES of ELTeC's novels (../shared/data/eltec-eng), the teacher's weights.
# Then, in device call K (carry [".dev/cK"]), one right after the other (each took 0.2-6 s):
#   mkdir -p /tmp/stage && cp .dev/cK/part* /tmp/stage/ && ls -la /tmp/stage
# and in the last one, after that copy, bench/gpu_students.py's command (its docstring).
set -euo pipefail
cd "$(dirname "$0")/.."
ELTEC_BYTES=${ELTEC_BYTES:-46000000}
CACHE=${DPDISTILL_MODEL_CACHE:-$HOME/.cache/dpdistill/models}
build=.dev/build
p=$build/payload
rm -rf .dev/c[0-9]* "$p" && mkdir -p "$p/whl" "$p/teacher"
[ -d .whl ] || bash bench/device_wheels.sh
cp .whl/*.whl "$p/whl/"
rm -f "$p"/whl/{datasets,dill,multiprocess}-*.whl  # not imported by the students' build
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
    cp "$CACHE/smollm2-135m/$f" "$p/teacher/"
done
xz -6 -c ../shared/data/wikitext-2/test.txt > "$p/wikitext-2-test.txt.xz"
if [ ! -f $build/eltec.txt.xz ] || [ "$(cat $build/eltec.bytes 2>/dev/null)" != "$ELTEC_BYTES" ]; then
    (set +o pipefail; cat ../shared/data/eltec-eng/text/*.txt | head -c "$ELTEC_BYTES" | xz -T2 -6 > $build/eltec.txt.xz)
    echo "$ELTEC_BYTES" > $build/eltec.bytes
fi
if [ ! -f $build/teacher_bf16.safetensors.xz ]; then
    .venv/bin/python -c 'import sys, torch; from safetensors.torch import load_file, save_file
save_file({k: v.bfloat16().contiguous() for k, v in load_file(sys.argv[1]).items()}, sys.argv[2], metadata={"format": "pt"})' \
        "$CACHE/smollm2-135m/model.safetensors" $build/teacher_bf16.safetensors
    xz -T2 -6 $build/teacher_bf16.safetensors
fi
cp $build/eltec.txt.xz $build/teacher_bf16.safetensors.xz "$p/"
source bench/payload_parts.sh
pack_parts $build
