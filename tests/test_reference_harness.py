"""experiments/reference.py, the resumable experiment driver of issue 12: its rows, resume, report, plots.

The pure parts run on hand-made result dicts; one tiny end-to-end runs a row through the real
flow twice and checks that the second start skips it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from experiments.reference import (
    FULL, Row, TABLE_ORDER, append_result, build_rows, epsilon_points, fig3_points, finished, format_report,
    main, read_results, table2, write_plots,
)
from experiments.shared import RULE_CANDIDATES


def _result(row: Row, run_dir: Path, student: float, *, teacher=30.0, base=70.0, samples=None, **extra) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    return {"experiment": row.experiment, "label": row.label, "overrides": list(row.overrides),
            "run_dir": str(run_dir), "seconds": 12.0, "method": "distil",
            "perplexity": {"student": student, "base_student": base, "dp_teacher": teacher},
            "epsilon": 1.998, "delta": 1e-3, "complete": True, "teacher_epsilon": 1.9, "train_samples": samples,
            "code_adherence": None, "stages": {"teacher": "cached"}, **extra}


@pytest.fixture
def everything(tmp_path) -> dict[tuple, dict]:
    """A finished result for every default row; student perplexities distinct per row."""
    rows = build_rows()
    done = {}
    for i, row in enumerate(rows):
        samples = int(row.label[2:]) if row.label.startswith("n=") else 19_800
        done[row.key] = _result(row, tmp_path / f"run{i}", 100.0 + i, teacher=25.0 + i, samples=samples)
    return done


def test_rows_cover_the_three_experiments_and_overrides_compose():
    rows = build_rows(extra=["seed=1"], per_experiment={"fig3": ["distill.epochs=3"]}, epsilon_samples=4000)
    labels = {(r.experiment, r.label) for r in rows}
    assert {("table", x) for x in ("ours", "DP-Syn", "ours+MSE", "DP-SGD", "DPKD")} <= labels
    assert [r.label for r in rows if r.experiment == "fig3"] == [FULL, "n=1000", "n=2500", "n=5000"]
    assert [r.label for r in rows if r.experiment == "epsilon"] == ["ε=1", "ε=2", "ε=4", "ε=8"]
    assert rows[0].label == "ours"  # first: the other synthetic rows find its teacher and data cached
    by = {(r.experiment, r.label): r for r in rows}
    # global overrides first, the experiment's next, the row's own last (they win)
    assert by["fig3", "n=1000"].overrides == ("seed=1", "distill.epochs=3", "distill.method=distil", RULE_CANDIDATES,
                                               "evaluate.adherence_samples=500", "distill.num_synthetic=1000",
                                               "evaluate.adherence_samples=0")
    assert by["epsilon", "ε=4"].overrides[-2:] == ("teacher.target_epsilon=4", "generate.num_samples=4000")
    assert by["table", "ours+MSE"].overrides == ("seed=1", "distill.method=distil", RULE_CANDIDATES,
                                                 "evaluate.adherence_samples=500", "distill.beta=1.0",
                                                 "evaluate.adherence_samples=0")
    # its two DP-SGD trainings compose to the others' budget by themselves (pipeline/plan.py): no ε override
    assert not [o for o in by["table", "DPKD"].overrides if o.startswith("teacher.target_epsilon")]
    plain = {(r.experiment, r.label): r for r in build_rows()}
    assert plain["fig3", FULL].overrides == plain["table", "ours"].overrides  # the same run: reused
    assert [r.experiment for r in build_rows(only=["epsilon"])] == ["epsilon"] * 4
    assert all(r.slug.replace("-", "").replace(".", "").isalnum() for r in rows)  # a valid run name part


def test_restart_skips_rows_in_results_jsonl_with_their_run_dir(tmp_path):
    """Only the exact (experiment, label, overrides) is skipped, and only while its run dir exists;
    a line cut short by a kill is ignored (its row runs again)."""
    rows = build_rows(only=["table"])
    path = tmp_path / "results.jsonl"
    append_result(path, _result(rows[0], tmp_path / "a", 50.0))
    append_result(path, _result(rows[1], tmp_path / "b", 60.0))
    other = Row(rows[2].experiment, rows[2].label, ("seed=7", *rows[2].overrides))
    append_result(path, _result(other, tmp_path / "c", 70.0))  # the same row with other overrides
    with open(path, "a") as f:
        f.write('{"experiment": "table", "lab')  # killed mid-write
    (tmp_path / "b").rmdir()  # a deleted run is run again

    done = finished(rows, read_results(path))
    assert list(done) == [rows[0].key]
    assert done[rows[0].key]["perplexity"]["student"] == 50.0


def test_table2_has_the_papers_rows_in_order_with_perplexity_first(everything):
    text = table2(everything)
    lines = text.splitlines()
    assert lines[0].split("|")[2].strip() == "perplexity"  # first numeric column
    body = [line.split("|") for line in lines[2:2 + len(TABLE_ORDER)]]
    assert [cells[1].strip() for cells in body] == list(TABLE_ORDER)
    ppl = {cells[1].strip(): cells[2].strip() for cells in body}
    paper = {cells[1].strip(): cells[-2].strip() for cells in body}
    by_label = {key[1]: r for key, r in everything.items() if key[0] == "table"}
    assert ppl["DPKD"] == f"{by_label['DPKD']['perplexity']['student']:.1f}"
    ours = by_label["ours"]
    assert ppl["zero-shot"] == "70.0" and ppl["DP teacher"] == f"{ours['perplexity']['dp_teacher']:.1f}"
    assert paper == {"zero-shot": "65.46", "DP-SGD": "48.12", "DPKD": "46.16", "DP-Syn": "61.84", "ours": "44.15",
                     "ours (α=0.4)": "–", "ours+MSE": "–", "DP teacher": "26.84"}
    assert "code adherence" in lines[0] and all(c[5].strip() == "–" for c in body)  # absent from metrics
    ratio = ours["perplexity"]["student"] / ours["perplexity"]["dp_teacher"]
    assert f"{ratio:.2f} (paper: 44.15 / 26.84 = 1.64)" in text


def test_report_of_a_partial_experiment_marks_what_is_missing(tmp_path):
    """--report-only during a run: rows not finished show "–", code adherence shows when present."""
    rows = build_rows(only=["table"])
    ours = next(r for r in rows if r.label == "ours")
    done = {ours.key: _result(ours, tmp_path / "o", 44.0, code_adherence=0.8125, complete=False)}
    body = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table2(done).splitlines()[2:9]}
    assert body["ours"] == ["44.0", "12", "1.998 (incomplete)", "0.812", "44.15"]
    assert body["DPKD"][:4] == ["–"] * 4
    assert "## Figure 3" in format_report(done) and "## Student perplexity against ε" in format_report(done)


def test_fig3_and_epsilon_tables_and_plots(everything, tmp_path):
    assert [n for n, _ in fig3_points(everything)] == [1000, 2500, 5000, 19_800]  # the full generation last
    assert [e for e, _ in epsilon_points(everything)] == [1, 2, 4, 8]
    report = format_report(everything)
    assert "| 19,800 (all) |" in report and "| 8 |" in report
    out = tmp_path / "plots"
    out.mkdir()
    written = write_plots(everything, out)
    assert [p.name for p in written] == ["fig3_samples.png", "fig_epsilon.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000 for p in written)
    assert write_plots({}, out / "none") == []  # nothing finished: nothing drawn


def test_driver_runs_a_row_once_and_skips_it_on_restart(prefect_server, tmp_path, capsys):
    """The real flow on a tiny config: the DP-SGD row runs, lands in results.jsonl and table.md;
    the second start runs nothing (no new run directory)."""
    from conftest import tiny_pipeline_dict

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_pipeline_dict(tmp_path)))
    argv = ["--config", str(config), "--only", "table", "--rows", "DP-SGD"]
    assert main(argv) == 0
    runs = tmp_path / "runs"
    results = read_results(runs / "results.jsonl")
    assert [(r["label"], r["method"]) for r in results] == [("DP-SGD", "dp_sgd")]
    assert 0 < results[0]["epsilon"] <= 8.0 and results[0]["perplexity"]["student"] > 1
    run_dirs = sorted(p.name for p in runs.iterdir() if p.name.startswith("tiny-"))
    assert run_dirs == [Path(results[0]["run_dir"]).name] and run_dirs[0].startswith("tiny-table-DP-SGD-")
    first = capsys.readouterr().out
    assert "[1/1] table / DP-SGD: running" in first and "stages ran:" in first

    assert main(argv) == 0
    assert "[1/1] table / DP-SGD: done before" in capsys.readouterr().out
    assert len(read_results(runs / "results.jsonl")) == 1
    assert sorted(p.name for p in runs.iterdir() if p.name.startswith("tiny-")) == run_dirs
    table = (runs / "table.md").read_text()
    assert f"| DP-SGD | {results[0]['perplexity']['student']:.1f} |" in table
    assert json.loads((runs / "results.jsonl").read_text())["stages"]["dp-student"] == "ran"


def test_every_rows_config_is_checked_before_anything_runs(tmp_path, capsys):
    """Figure 3 sizes beyond the generation stop the driver at once, naming each row, with
    nothing run and nothing written."""
    from conftest import tiny_pipeline_dict

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_pipeline_dict(tmp_path)))  # generate.num_samples: 24
    assert main(["--config", str(config), "--only", "fig3", "--fig3-sizes", "12,30,40"]) == 2
    err = capsys.readouterr().err
    assert "row fig3 / n=30" in err and "row fig3 / n=40" in err and "n=12" not in err
    assert "distill.num_synthetic=40 asks for more synthetic samples than generate.num_samples=24" in err
    assert not (tmp_path / "runs").exists()
    with pytest.raises(SystemExit):
        main(["--config", str(config), "--epsilons", "1,two"])


def test_a_failed_row_is_reported_and_the_others_go_on(tmp_path, capsys):
    """A row that fails is named, not written to results.jsonl (a restart retries it), and the
    rows after it still run (here they fail too: the config file is missing)."""
    from experiments.reference import run_rows

    rows = build_rows(only=["table"])[:2]
    failed = run_rows(rows, {}, tmp_path / "results.jsonl", str(tmp_path / "missing.yaml"), "x")
    assert failed == ["table / ours", "table / DP-Syn"]
    assert "[2/2] table / DP-Syn: FAILED (ConfigError" in capsys.readouterr().out
    assert not (tmp_path / "results.jsonl").exists()
