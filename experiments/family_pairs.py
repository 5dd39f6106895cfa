"""Tiny random-init teacher/student pairs of other decoder families, sharing the builtin tokenizer,
for running the demo with models that are not GPT-2 (issue 35's "Done when"):

    OMP_NUM_THREADS=1 .venv/bin/python experiments/family_pairs.py /tmp/fam
    for fam in llama qwen2 gpt_neox; do
      OMP_NUM_THREADS=2 .venv/bin/dpdistill run --config configs/demo.yaml teacher.model=/tmp/fam/$fam-teacher \\
        distill.student_model=/tmp/fam/$fam-student data.max_records=300 run_root=/tmp/fam/runs name=fam-$fam
    done

The models are the test matrix's (tests/families.py: 2 layers of 64, grouped-query attention where
the family has it), the student seeded apart from the teacher; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="a directory: FAMILY-teacher and FAMILY-student are written in it")
    p.add_argument("--families", nargs="+", default=["llama", "qwen2", "gpt_neox"])
    a = p.parse_args()

    import torch
    import transformers

    FAMILIES = runpy.run_path(str(ROOT / "tests" / "families.py"))["FAMILIES"]  # the tests' builders, not a package

    unknown = sorted(set(a.families) - set(FAMILIES))
    if unknown:
        p.error(f"unknown families {unknown}; choose among {sorted(FAMILIES)}")
    tok = transformers.AutoTokenizer.from_pretrained(ROOT / "pipeline/models/builtin/teacher")
    for fam in a.families:
        for role, seed in (("teacher", 0), ("student", 1)):
            torch.manual_seed(seed)
            model = FAMILIES[fam](len(tok), tok.eos_token_id)
            model.save_pretrained(a.out / f"{fam}-{role}")
            tok.save_pretrained(a.out / f"{fam}-{role}")
            size = sum(w.numel() for w in model.parameters())
            print(f"{fam} {role}: {size:,} parameters -> {a.out / f'{fam}-{role}'}")


if __name__ == "__main__":
    main()
