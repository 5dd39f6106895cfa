"""A study run on a lent GPU (bench/device_study.sh) comes back as whole copies of the results
files it appended to: merging them here adds only their new lines, keeps the lines a study here
appended meanwhile, and a results line says where a run computed when it was not a CPU in fp32."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from experiments.shared import where_run
from pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def _merge_module():
    spec = importlib.util.spec_from_file_location("device_study_merge", ROOT / "bench" / "device_study_merge.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_merge_adds_the_devices_new_lines_and_keeps_the_ones_appended_here(tmp_path):
    merge = _merge_module().merge
    old = [json.dumps({"row": "public-only", "repeat": k}) for k in (1, 2)]
    tracked, returned = tmp_path / "tracked" / "utility.jsonl", tmp_path / "back" / "utility.jsonl"
    tracked.parent.mkdir(), returned.parent.mkdir()
    here = json.dumps({"row": "ours", "repeat": 1})  # appended here while the device ran
    there = [json.dumps({"row": "ours", "repeat": k, "device": "cuda"}) for k in (2, 3)]
    tracked.write_text("".join(f"{line}\n" for line in [*old, here]))
    returned.write_text("".join(f"{line}\n" for line in [*old, *there]))
    assert merge(returned, tracked) == there
    assert tracked.read_text().splitlines() == [*old, here, *there]
    assert merge(returned, tracked) == []  # a second merge adds nothing


def test_the_merge_refuses_a_file_that_is_not_a_tracked_results_file(tmp_path, capsys):
    log = tmp_path / "study.log"
    log.write_text("== ours run 1\n")
    assert _merge_module().main([str(log)]) == 2
    assert "not a results file of docs/results/" in capsys.readouterr().err


def test_a_results_line_says_where_it_ran_only_off_the_cpu_in_fp32():
    cfg = load_config(str(ROOT / "configs" / "demo.yaml"), ["device=cpu"])
    assert where_run(cfg) == {}  # every line before the device studies: unchanged
    bf16 = load_config(str(ROOT / "configs" / "demo.yaml"), ["device=cpu", "precision=bf16"])
    assert where_run(bf16) == {"device": "cpu", "precision": "bf16"}
