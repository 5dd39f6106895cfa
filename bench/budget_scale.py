"""Benchmark: the dataset budget's record digests at scale, the set of hex strings it kept before
issue 23 and the sorted 16-byte array it keeps now, side by side.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/budget_scale.py --records 1000000

Writes a training split of N distinct records (short synthetic texts, 7 codes), then digests it
in a fresh subprocess per path, so that each peak RSS is its own: `set` reads the split into
Python lists and keeps a set of 32-hex-digit strings (the code before), `array` streams it
(`budget.split_digests`). Peak RSS is VmHWM minus the RSS after the imports. Last line:
`records=N set_peak_mb=A array_peak_mb=B set_s=S array_s=T`.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KEY = b"k" * 32  # a benchmark key: the records are synthetic


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _child(path: str, kind: str) -> dict:
    from pipeline.privacy.budget import split_digests
    from pipeline.records import read_split

    baseline, t0 = _status("VmRSS"), time.perf_counter()
    if kind == "set":
        codes, texts = read_split(Path(path))
        n = len({hmac.new(KEY, json.dumps([c, t]).encode(), hashlib.sha256).hexdigest()[:32]
                 for c, t in zip(codes, texts)})
    else:
        n = len(split_digests(Path(path), KEY))
    return {"digests": n, "seconds": time.perf_counter() - t0, "peak_mb": _status("VmHWM") - baseline}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child)))
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory(prefix="budget_scale-") as tmp:
        split = Path(tmp) / "train.parquet"
        n = args.records
        pq.write_table(pa.table({"control_code": [f"Category: {i % 7}" for i in range(n)],
                                 "text": [f"review number {i} " * 8 for i in range(n)]}), split, row_group_size=16_384)
        out = {}
        for kind in ("set", "array"):
            run = subprocess.run([sys.executable, __file__, "--child", str(split), kind], check=True,
                                 stdout=subprocess.PIPE, text=True)
            out[kind] = r = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"{kind:>5}: {r['digests']} digests in {r['seconds']:.1f} s, peak RSS {r['peak_mb']:.0f} MB above imports")
        print(f"records={n} set_peak_mb={out['set']['peak_mb']:.0f} array_peak_mb={out['array']['peak_mb']:.0f} "
              f"set_s={out['set']['seconds']:.1f} array_s={out['array']['seconds']:.1f}")


if __name__ == "__main__":
    main()
