"""experiments/confirmation.py's report: mean ± sd over repeated runs and the issue's last line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("confirmation", ROOT / "experiments" / "confirmation.py")
confirmation = importlib.util.module_from_spec(spec)
spec.loader.exec_module(confirmation)


def _run(row, k, student, **extra):
    return {"row": row, "repeat": k, "student": student, "student_per_record_mean": student * 0.8,
            "zero_shot": 500.0, "dp_teacher": 120.0 + k, "epsilon": 1.98, "seconds": 100.0, **extra}


def test_the_report_gives_mean_and_sd_and_ends_with_the_summary_line():
    sel = {"chosen": "alpha=1.0", "criterion_study": {"teacher_kl": {"regret": 0.0}},
           "candidates": [{"candidate": "alpha=0.4", "teacher_kl": 0.3, "untruncated_ce": 4.0,
                           "synthetic_validation_ce": 3.0, "test_perplexity": 170.0},
                          {"candidate": "alpha=1.0", "teacher_kl": 0.2, "untruncated_ce": 3.9,
                           "synthetic_validation_ce": 3.2, "test_perplexity": 160.0}]}
    results = [_run("ours", 1, 160.0, selection=sel), _run("ours", 2, 162.0, selection=sel),
               _run("ours", 3, 164.0, selection=sel), _run("DP-SGD", 1, 180.0), _run("DP-SGD", 2, 184.0),
               _run("DPKD", 1, 185.0)]
    text = confirmation.report(results, "airline")
    assert text.strip().splitlines()[-1] == "corpus=airline ours=162.0±2.0 dpsgd=182.0±2.8 dpkd=185.0±–"
    assert "| ours | 3 | 162.0±2.0 | 160.0, 162.0, 164.0 |" in text
    assert "| DP teacher | 3 | 122.0±1.0 |" in text and "| zero-shot | 3 | 500.0±0.0 |" in text
    assert "| r1 | → | alpha=1.0 | 0.2000 |" in text and "Regret" in text


def test_the_table_gives_the_per_record_and_text_only_figures_and_reads_older_results():
    """Issue 37: beside the windowed figure, the per-record median and token-weighted figures and
    the text-only ones; a result written before them has the per-record mean alone."""
    new = {"student_per_record_median": 150.0, "student_per_record_token_weighted": 170.0,
           "student_text_windowed": 300.0, "student_text_per_record_median": 280.0,
           "student_text_per_record_token_weighted": 320.0}
    results = [_run("ours", 1, 160.0, **new), _run("ours", 2, 162.0, **{k: v + 2 for k, v in new.items()}),
               _run("DP-SGD", 1, 180.0)]
    lines = confirmation.report(results, "airline").splitlines()
    assert "| text alone: windowed |" in lines[0]
    assert ("| ours | 2 | 161.0±1.4 | 160.0, 162.0 | 128.8±1.1 | 151.0±1.4 | 171.0±1.4 | 301.0±1.4 | 281.0±1.4 "
            "| 321.0±1.4 | 1.980, 1.980 | 100, 100 |") in lines
    assert "| DP-SGD | 1 | 180.0±– | 180.0 | 144.0±– | – | – | – | – | – | 1.980 | 100 |" in lines
    assert all(line.count("|") == lines[0].count("|") for line in lines[:6])  # every row has every column


def test_every_repeat_after_the_first_reruns_the_stages_that_draw_noise():
    """Each row's repeat reruns its method's first noisy stage: DPKD its DP teacher too (before
    2026-11-30 its repeats reran the dp-student alone and shared one teacher)."""
    from pipeline.config import load_config
    from pipeline.methods import method_spec

    assert [k for label, k in confirmation.SCHEDULE if label == "ours"] == [1, 2, 3]
    stages = {label: method_spec(load_config(ROOT / "configs/reference.yaml", list(o)).distill.method).noisy_stage
              for label, o in confirmation.ROWS.items()}
    assert stages == {"ours": "control-codes", "DP-SGD": "dp-student", "DPKD": "teacher", "DP-Syn": "control-codes"}


def test_two_configs_sharing_a_run_root_keep_their_own_runs(tmp_path):
    """configs/smollm2_airline.yaml and smollm2_yelp.yaml share runs/real_model: the Yelp study must
    not take the airline runs for its own and skip every run (it did, before each line named its
    config); a line written before that is its run directory's."""
    from experiments.shared import append_result, read_results

    path = tmp_path / "confirmation.jsonl"
    append_result(path, _run("ours", 1, 179.0, run_dir="/r/smollm2-airline-ours-r1-20261126-031610"))
    append_result(path, _run("DPKD", 2, 700.0, run_dir="/r/smollm2-airline-dpkd-c2-r2-20261126-093842"))
    append_result(path, {"config": "smollm2-yelp", **_run("ours", 1, 60.0)})
    append_result(path, {"config": "airline", "kind": "selection", "row": "dpsgddep", "repeat": 1})
    assert [r["student"] for r in read_results(path, "smollm2-airline")] == [179.0, 700.0]
    assert [r["student"] for r in read_results(path, "smollm2-yelp")] == [60.0]
    assert [r["row"] for r in read_results(path, "airline")] == ["dpsgddep"]
    assert len(read_results(path)) == 4 and read_results(tmp_path / "none.jsonl", "x") == []


def test_with_a_cached_model_the_report_ends_with_the_model_and_downstream_lines():
    ds = {"sentiment": {"macro_f1": 0.36, "chance_macro_f1": 1 / 3, "real_reference_macro_f1": 0.555}}
    results = [_run("ours", 1, 178.0, downstream=ds),
               _run("ours", 2, 180.0, downstream={"sentiment": {**ds["sentiment"], "macro_f1": 0.38}}),
               _run("DP-SGD", 1, 700.0), _run("DP-SGD", 2, 740.0), _run("DPKD", 1, 750.0)]
    lines = confirmation.report(results, "airline", "smollm2-135m").strip().splitlines()
    assert lines[-2] == ("model=smollm2-135m corpus=airline runs=1 ours=179.0±1.4 dpsgd=720.0±28.3 "
                         "dpkd=750.0±– zero_shot=500.0")
    assert lines[-1] == ("downstream model=smollm2-135m corpus=airline column=sentiment synthetic_f1=0.370 "
                         "chance=0.333 sd=0.014 runs=2 real_reference=0.555")
    assert not confirmation.report(results, "airline").strip().splitlines()[-1].startswith("downstream")


def test_the_results_file_can_be_a_tracked_one_outside_the_run_root(tmp_path, capsys):
    """A run root is not tracked: `--results` names the file the finished runs go to and are read
    from (docs/results/ in this repo), so a new checkout does not lose them or run them again. A
    line without the figures the selection criteria carry (transcribed from the docs) still reports."""
    from experiments.shared import append_result

    path = tmp_path / "kept" / "yelp.jsonl"
    path.parent.mkdir()
    sel = {"chosen": "alpha=1.0", "candidates": [{"candidate": "alpha=1.0", "test_perplexity": 201.0}]}
    append_result(path, {"config": "smollm2-yelp", **_run("ours", 1, 201.0, selection=sel)})
    root = tmp_path / "root"
    assert confirmation.main(["--config", "configs/smollm2_yelp.yaml", f"run_root={root}", "--results", str(path),
                              "--report-only", "--corpus", "yelp"]) == 0
    out = capsys.readouterr().out
    assert "corpus=yelp ours=201.0±– dpsgd=– dpkd=–" in out
    assert "| r1 | → | alpha=1.0 | – | – | – | 201.0 |" in out
    assert not (root / "confirmation.jsonl").exists()


def test_a_results_line_keeps_the_teachers_code_adherence_without_the_per_value_detail(tmp_path):
    """Why a code column fails downstream: whether the DP teacher recognises its codes in its own
    text (pipeline/stages/adherence.py) travels with each results line, per column."""
    import json

    ppl = {"windowed": 200.0, "per_record_mean": 250.0, "per_record_median": 190.0, "per_record_token_weighted": 201.0}
    metrics = {"perplexity": {"student_distil": {**ppl, "text_only": ppl}, "base_student": ppl},
               "code_adherence": {"columns": {"label2": {"share": 0.33, "chance": 0.2, "n": 30,
                                                         "values": {"Review Stars: 1.0": {"share": 0.5, "n": 6}}}}}}
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    (tmp_path / "ledger.json").write_text(json.dumps({"total": {"epsilon": 1.98, "delta": 1e-5}}))
    line = confirmation._result("ours", 1, tmp_path, 12.0)
    assert line["code_adherence"] == {"label2": {"share": 0.33, "chance": 0.2, "n": 30}}
    assert line["student"] == 200.0 and line["dp_teacher"] is None
    del metrics["code_adherence"]
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    assert "code_adherence" not in confirmation._result("ours", 1, tmp_path, 12.0)


def test_the_report_says_when_dpkds_repeats_share_one_dp_teacher():
    """The DPKD rows of docs/results/yelp.jsonl, airline.jsonl and smollm2_yelp.jsonl were made when
    a DPKD repeat reran its student alone: the report says their spread leaves the teacher's out."""
    results = [_run("ours", 1, 160.0)] + [_run("DPKD", k, 185.0 + k, dp_teacher=132.9) for k in (1, 2, 3)]
    assert "DPKD: 3 runs read 1 DP teacher(s) (132.9)" in confirmation.report(results, "reference")
    fresh = [_run("ours", 1, 160.0)] + [_run("DPKD", k, 185.0 + k) for k in (1, 2, 3)]
    assert "teacher(s)" not in confirmation.report(fresh, "reference")
