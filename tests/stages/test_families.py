"""Every decoder family of the matrix through every stage (issue 35 item 6, CONVENTIONS 15):
a tiny random-init teacher of each family trains one DP-SGD step in bk, ghost and LoRA (bk)
with its ledger entry, writes synthetic samples with the fast engine and the hf reference,
distils a student of its own family, half as wide, for one epoch (the teacher's logits and the hidden-state MSE
across widths), and is evaluated (`families.every_stage`; bench/family_matrix.py runs the same
on a GPU in bf16). bk's exactness per family is tests/privacy/test_bk_families.py,
the engine's per family tests/models/test_decoding_families.py; this checks the stages run them."""

from __future__ import annotations

import pytest

from families import FAMILIES, every_stage, save_pair
from pipeline.devices import CPU_FP32

NAMES = sorted(FAMILIES)


@pytest.fixture(scope="module")
def family_dirs(tiny_tokenizer, tmp_path_factory):
    """Per family: a teacher (2 layers × 64, FAMILIES) and a student half as wide, saved."""
    root = tmp_path_factory.mktemp("families")
    return {name: save_pair(name, tiny_tokenizer, root) for name in NAMES}


@pytest.mark.parametrize("family", NAMES)
def test_a_family_goes_through_every_stage(family, family_dirs, splits, tmp_path):
    every_stage(family, family_dirs[family], splits, tmp_path, CPU_FP32)
