"""experiments/students.py: a cached student's build record goes to the tracked jsonl once, and
the table puts its public held-out perplexity beside its teacher's against the issue's 2.5× bar."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("students", ROOT / "experiments" / "students.py")
students = importlib.util.module_from_spec(spec)
spec.loader.exec_module(students)


def _student(cache: Path, name: str, layers: list[int], after: float) -> None:
    d = cache / name
    d.mkdir(parents=True)
    budget = {"steps": 500, "seq_len": 256, "batch_size": 4, "learning_rate": 3e-4, "eval_tokens": 16384}
    model = {"name": name, "teacher": "smollm2-135m", "layers_kept": layers, "teacher_layers": 30,
             "parameters": 42_500_000, "non_embedding_parameters": 14_000_000, "teacher_parameters": 134_515_008,
             "corpus": {"path": "/somewhere/wikitext-2-valid.txt", "sha256": {"wikitext-2-valid.txt": "ab"},
                        "training_tokens": 205_579, "held_out_tokens": 16_384},
             "budget": budget, "seed": 0, "teacher_perplexity": 50.0, "perplexity_before": 3e6,
             "perplexity_after": after, "healing": {"threads": 1, "seconds": 100.0}, "seconds": 120.0}
    (d / "manifest.json").write_text(json.dumps({"stage": "model-cache", "model": model,
                                                 "build": {"teacher": "smollm2-135m", "keep": layers}}))


def test_a_student_is_recorded_once_and_judged_against_the_bar(tmp_path, capsys):
    cache, results = tmp_path / "cache", tmp_path / "students.jsonl"
    _student(cache, "smollm2-135m-4l", [0, 10, 19, 29], 278.5)
    _student(cache, "smollm2-135m-12l", list(range(12)), 110.0)
    args = ["--cache-dir", str(cache), "--results", str(results)]
    students.main([*args, "--record", "smollm2-135m-4l", "--record", "smollm2-135m-12l"])
    students.main([*args, "--record", "smollm2-135m-4l"])  # the same build again: not appended
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["name"] for r in rows] == ["smollm2-135m-4l", "smollm2-135m-12l"]
    assert rows[0]["corpus"]["path"] == "wikitext-2-valid.txt"  # no machine's absolute path is tracked
    table = capsys.readouterr().out.splitlines()
    assert "| 3000000 → 278.5 | 50.0 | 5.57× ✗ |" in table[-2]
    assert "| 3000000 → 110.0 | 50.0 | 2.20× ✓ |" in table[-1]


def test_a_model_that_is_not_a_built_student_is_refused(tmp_path):
    (tmp_path / "smollm2-135m").mkdir()
    (tmp_path / "smollm2-135m" / "manifest.json").write_text(json.dumps({"stage": "model-cache", "model": {}}))
    with pytest.raises(SystemExit, match="not a student built by"):
        students.record_of(tmp_path / "smollm2-135m")
