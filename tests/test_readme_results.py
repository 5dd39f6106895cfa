"""docs/readme_results.py: the README's "What you get" block is rewritten from a run directory,
and nothing outside its markers changes."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from pipeline.privacy.ledger import LedgerEntry, LedgerTotal, PrivacyLedger, post_processing, write_ledger

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("readme_results", ROOT / "docs" / "readme_results.py")
readme_results = importlib.util.module_from_spec(spec)
spec.loader.exec_module(readme_results)

STAGES = {"base-models": 0.1, "data": 0.2, "control-codes": 0.5, "teacher": 161.5, "generation": 15.6,
          "distillation": 81.9, "evaluation": 87.4}


def _ppl(windowed: float, mean: float) -> dict:
    return {"model": "m", "windowed": windowed, "per_record_mean": mean, "per_record_median": mean, "tokens": 9,
            "records": 5}


def fake_run(root: Path, status: str = "completed") -> Path:
    """What a finished demo run leaves that the script reads (no models, no records)."""
    run = root / "runs" / "demo-20261126-101500"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("name: demo\nteacher:\n  model: builtin:teacher\ndistill:\n"
                                     "  student_model: builtin:student\n")
    (run / "run.json").write_text(json.dumps({
        "tool": "dpdistill", "status": status, "host": "h", "pid": 1, "run_root": str(root / "runs"),
        "started_at": "2026-11-26T10:15:00", "finished_at": "2026-11-26T10:21:03"}))
    (run / "stages.json").write_text(json.dumps({
        name: {"status": "ran", "seconds": s, "output": str(run / name), "epsilon": None} for name, s in STAGES.items()}))
    teacher = LedgerEntry(stage="teacher", private=True, epsilon=1.9902, delta=7e-5, accountant="prv",
                          mechanism="subsampled_gaussian", noise_multiplier=1.284, sample_rate=0.0833, steps=36,
                          max_grad_norm=1.0, privacy_unit="record", history=[(1.284, 0.0833, 36)],
                          epsilon_replace_one=3.0397, note="DP-SGD")
    total = LedgerTotal(epsilon=2.0661, delta=7e-5, accountant="prv", composition="prv accountant", complete=True,
                        note="(ε, δ)-DP per record", epsilon_replace_one=3.1675)
    write_ledger(run / "ledger.json", PrivacyLedger(entries=[teacher, post_processing("evaluation", "e")], total=total))
    cands = [{"candidate": "alpha=0.4", "settings": {"alpha": 0.4}, "teacher_kl": 0.536},
             {"candidate": "alpha=1.0", "settings": {"alpha": 1.0}, "teacher_kl": 0.322}]
    (run / "metrics.json").write_text(json.dumps({
        "test_records": 500, "method": "distil",
        "perplexity": {"base_student": _ppl(537.1, 701.1), "base_teacher": _ppl(411.6, 575.9),
                       "dp_teacher": _ppl(171.7, 123.8), "student_distil": _ppl(225.48, 158.71)},
        "selection": {"select_by": "teacher_kl", "chosen": "alpha=1.0", "selection_samples": 128, "candidates": cands},
        "downstream": {"useful": False}, "seconds": STAGES}))
    (run / "run.log").write_text(
        "10:20:50.100 | INFO    | pipeline.stages.evaluate - evaluation: dp_teacher perplexity 171.70 (windowed)\n"
        "10:20:59.200 | INFO    | pipeline.stages.evaluate - evaluation: student_distil perplexity 225.48 "
        "(windowed, 95272 tokens), per-record mean 158.71 / median 145.03\n"
        "10:21:01.300 | WARNING | pipeline.stages.evaluate - evaluation: a classifier trained on the synthetic text "
        "predicts no better than chance (label1: macro-F1 0.073 (accuracy 0.540) trained on synthetic, 0.115 real "
        "reference (AT CHANCE)): the synthetic data does not carry the codes.\n"
        "10:21:01.400 | INFO    | Task run 'evaluation-e54' - Finished in state Completed()\n"
        "10:21:03.000 | INFO    | Flow run 'rousing-okapi' - finished: /x\n")
    return run


def _split(text: str) -> tuple[str, str, str]:
    head, rest = text.split(readme_results.START)
    block, tail = rest.split(readme_results.END)
    return head, block, tail


def test_the_block_is_rewritten_from_the_run_and_nothing_else_changes(tmp_path):
    run = fake_run(tmp_path)
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    before = readme.read_text()
    assert readme_results.main([str(run), "--readme", str(readme), "--commit", "abc1234"]) == 0
    after = readme.read_text()
    head, block, tail = _split(after)
    old_head, old_block, old_tail = _split(before)
    assert (head, tail) == (old_head, old_tail)  # everything outside the markers, byte for byte
    assert block != old_block
    for figure in ("| **225.5** | 158.7 | 2.07 (whole run) | 3.17 (whole run) |", "| DP teacher | 171.7 | 123.8 | 1.99 | 3.04 |",
                   "base student (`builtin:student`) | 537.1", "(α = 1, chosen by the rule)", "on 500 held-out records",
                   "commit abc1234, 6 min 3 s wall", "(0.32 against 0.54)", "fell by 58 %",
                   "10:20:59 INFO  evaluation: student_distil perplexity 225.48", "(...)",
                   "run directory: runs/demo-20261126-101500", "$ dpdistill status runs/demo-20261126-101500",
                   "teacher        finished  161.5    ", "TOTAL all DP 2.066 3.167 7e-05"):
        assert figure in block or figure in " ".join(block.split()), figure
    assert "Task run" not in block and "dp_teacher perplexity" not in block and str(tmp_path) not in block
    assert readme_results.main([str(run), "--readme", str(readme), "--commit", "abc1234"]) == 0
    assert readme.read_text() == after  # the same run gives the same block


def test_a_run_log_in_the_cli_s_early_format_is_read_too(tmp_path):
    """`dpdistill run` writes run.log lines in Opacus' basicConfig format ("11/26/2026 00:27:49:INFO:...")
    when it configured logging first: the same lines come out."""
    run = fake_run(tmp_path)
    text = (run / "run.log").read_text().replace("10:20:59.200 | INFO    | pipeline.stages.evaluate - ",
                                                  "11/26/2026 10:20:59:INFO:")
    (run / "run.log").write_text(text)
    assert "10:20:59 INFO  evaluation: student_distil perplexity 225.48" in "\n".join(readme_results.last_lines(run))


def test_the_shipped_readme_has_one_block_to_rewrite():
    head, block, tail = _split((ROOT / "README.md").read_text())
    assert "## What you get" in head and "```" in block and "## The privacy guarantee" in tail


def test_an_unfinished_run_or_a_readme_without_markers_is_one_line_and_changes_nothing(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    run = fake_run(tmp_path)
    assert readme_results.main([str(run), "--readme", str(readme), "--commit", "abc1234"]) == 2
    assert "must hold one <!-- results:start -->" in capsys.readouterr().err
    assert readme.read_text() == "# no markers\n"
    shutil.copy(ROOT / "README.md", readme)
    unfinished = fake_run(tmp_path / "other", status="interrupted")
    assert readme_results.main([str(unfinished), "--readme", str(readme), "--commit", "abc1234"]) == 2
    assert "is not a finished run" in capsys.readouterr().err
    assert readme.read_text() == (ROOT / "README.md").read_text()


def test_a_head_committed_after_the_run_is_not_taken_for_its_commit():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    with pytest.raises(readme_results.ResultsError, match="newer than the run"):
        readme_results.head_commit("2000-01-01T00:00:00")
