"""The family matrix of the tests on a given device and precision (issue 35 item 8: bf16 on CUDA).

For each decoder family of tests/families.py (GPT-2, Llama, Qwen2, Mistral, Gemma, GPT-NeoX,
Phi-3, OPT; tiny random-init, no download) the same checked chain as
tests/stages/test_families.py (`families.every_stage`): one DP-SGD teacher step in bk, ghost
(not Gemma, OPT: refused at preflight) and LoRA with its ledger entry, 16 samples with the fast
engine and with the hf reference, one distillation epoch, evaluation. The tokenizer is the
builtin teacher's (vocabulary 8,192), the splits the repository's Yelp sample (100 training
records). Prints each part's wall seconds per family, or the family's error, so one failing
family does not hide the others. The models are tiny: the seconds are set-up and kernel-launch
bound, a check that every path runs on the device, not a speed figure. Run from the repository root:

    .venv/bin/python bench/family_matrix.py --device cuda --precision bf16
    .venv/bin/python bench/family_matrix.py                       # CPU, fp32: ~2 min

The last line reads `families passed=P failed=F device=D precision=X`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.families import FAMILIES, every_stage, save_pair  # noqa: E402
from pipeline.config import DataConfig  # noqa: E402
from pipeline.devices import Runtime  # noqa: E402
from pipeline.models.base import load_tokenizer  # noqa: E402
from pipeline.stages.data import prepare_data  # noqa: E402

PARTS = ("teacher_bk", "teacher_ghost", "teacher_lora", "generation_fast", "generation_hf", "distillation", "evaluation")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=sorted(FAMILIES))
    a = ap.parse_args()
    runtime = Runtime(torch.device(a.device), a.precision, 1)
    where = torch.cuda.get_device_name() if a.device.startswith("cuda") else "CPU, 1 thread"
    print(f"{where}, {a.precision} | torch {torch.__version__}\n")
    print("| family | " + " | ".join(PARTS) + " |\n|---|" + "---:|" * len(PARTS), flush=True)
    tok = load_tokenizer(str(ROOT / "pipeline" / "models" / "builtin" / "teacher"))
    passed = failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        splits = prepare_data(DataConfig(path=ROOT / "data" / "yelp_sample" / "train.csv",
                                         test_path=ROOT / "data" / "yelp_sample" / "test.csv",
                                         max_records=110, max_test_records=10, validation_fraction=0.1),
                              root / "data")
        for family in a.families:
            t0 = time.perf_counter()
            try:
                seconds = every_stage(family, save_pair(family, tok, root / "models"), splits, root / family, runtime)
            except Exception as e:  # noqa: BLE001  one family's failure is a row, not the end of the table
                traceback.print_exc(file=sys.stderr)
                print(f"| {family} | failed after {time.perf_counter() - t0:.1f} s: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:160] if str(e) else ''} |", flush=True)
                failed += 1
                continue
            passed += 1
            print(f"| {family} | " + " | ".join(f"{seconds[p]:.2f}" if p in seconds else "refused (preflight)"
                                                for p in PARTS) + " |", flush=True)
    print(f"\nfamilies passed={passed} failed={failed} device={a.device} precision={a.precision}")


if __name__ == "__main__":
    main()
