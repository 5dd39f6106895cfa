"""A run that did not help says so, and what to try: a student no better than its base (the
'new user on a news corpus' case of issue 12), a DP teacher that learned nothing, synthetic
text that ignores its codes. Computed from published aggregates only."""

from __future__ import annotations

import json

from pipeline.stages.evaluate import diagnose
from pipeline.reports.report import write_report
from test_report import make_run


def _result(student: float, *, base_student=800.0, base_teacher=600.0, dp_teacher=300.0, adherence=None) -> dict:
    ppl = {"base_student": base_student, "base_teacher": base_teacher, "dp_teacher": dp_teacher,
           "student_distil": student}
    result = {"perplexity": {name: {"windowed": v} for name, v in ppl.items()}}
    if adherence is not None:
        result["code_adherence"] = {"overall": adherence, "columns": {
            "topic": {"chance": 0.1, "n": 50}, "stars": {"chance": 0.2, "n": 50}, "unscored": {"chance": 1.0, "n": 0}}}
    return result


def test_a_run_that_helped_gets_no_warning():
    assert diagnose(_result(400.0, adherence=0.5)) == []


def test_a_student_worse_than_its_base_is_named_with_what_to_try():
    [line] = diagnose(_result(911.0, base_student=814.0))
    assert "distil student (911.0) is no better than its base model (814.0)" in line
    assert "generate.num_samples" in line and "base_models.corpus" in line


def test_a_teacher_that_learned_nothing_and_codes_that_are_ignored():
    lines = diagnose(_result(400.0, dp_teacher=610.0, adherence=0.2))
    assert len(lines) == 2
    assert "DP teacher (610.0) is no better than its base model (600.0)" in lines[0]
    # chance averages the scored columns only (0.15): 0.2 < 1.5 × 0.15
    assert "barely follows its control codes (code adherence 0.20 against 0.15 by chance)" in lines[1]
    assert diagnose(_result(400.0, adherence=0.23)) == []  # above 1.5 × chance


def test_adherence_above_chance_beside_a_classifier_at_chance_is_explained_not_contradicted():
    """Issue 37: the DP teacher judged adherence 0.48-0.68 (chance 0.25) where a classifier trained on
    the same text was at chance. Both hold: the warning says what each measures, and metrics.json
    carries the same words beside each figure."""
    from pipeline.stages.adherence import summarize
    from pipeline.stages.downstream import code_classification

    at_chance = {"useful": False, "columns": {"topic": {
        "synthetic": {"macro_f1": 0.18, "accuracy": 0.3}, "real_reference": {"macro_f1": 0.8},
        "chance_macro_f1": 0.25, "at_chance": True}}}
    [line] = diagnose({**_result(400.0, adherence=0.6), "downstream": at_chance})
    assert "does not carry what distinguishes the codes in real text" in line
    assert "Code adherence (0.60) is above chance meanwhile" in line and "recognises its own codes" in line
    [line] = diagnose({**_result(400.0), "downstream": at_chance})  # no adherence scored: nothing to explain
    assert "Code adherence" not in line
    assert "recognises" in summarize([], {"a": ["x", "y"]})["measures"]
    assert "in real text" in code_classification([], [], [], [], [])["measures"]


def test_the_report_shows_the_warnings_above_the_perplexities(tmp_path):
    run = make_run(tmp_path, "distil")
    metrics = json.loads((run / "metrics.json").read_text())
    metrics["diagnostics"] = diagnose(_result(911.0, base_student=814.0))
    (run / "metrics.json").write_text(json.dumps(metrics))
    page = write_report(run).read_text()
    section = page[page.index("<h2>Perplexity per model</h2>"):]
    assert section.index("Warning: the distil student (911.0)") < section.index("<svg")
