"""The run report: built from a hand-made run directory (small JSON and Parquet files, no training)."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from browser import BROWSER, Chromium
from flows.cli import main as cli_main
from pipeline.stages.adherence import SampleOutcome, summarize
from pipeline.privacy.ledger import LedgerEntry, LedgerTotal, PrivacyLedger, post_processing, write_ledger
from pipeline.reports.report import REPORT, write_comparison_report, write_report

SECRET = "PRIVATE-RECORD-q7Zx"  # planted in data/: must never reach a report
SYNTHETIC_TEXT = "SYNTHETIC-TEXT-k2Vw"  # the report shows lengths only, never generated text
CODES = ["Bars\tStars: 1.0", "Bars\tStars: 5.0", "Shopping\tStars: 3.0"]
# Namespace names that inline SVG declares; identifiers, never fetched.
SVG_NAMESPACES = {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}


def _json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def _dp_log(last_epsilon: float, loss0: float, monitor: str = "none") -> dict:
    """What a DP-SGD stage writes: no batch loss or size; a validation loss only when monitored."""
    history = [{"step": s} for s in range(1, 13)]
    for h in history:
        if h["step"] % 5 == 0 or h["step"] == 12:
            h["epsilon"] = last_epsilon * (h["step"] / 12) ** 0.5  # recorded values, as the accountant wrote them
            h["epsilon_replace_one"] = 1.5 * h["epsilon"]
            if monitor != "none":
                h["validation_loss"] = loss0 - 0.05 * h["step"]
            h["seconds"] = 2.0 * h["step"]
    log = {"history": history, "monitor": monitor, "resumed_from_step": 0}
    return log | ({"validation_loss": loss0 - 0.6} if monitor != "none" else {})


def make_run(root: Path, method: str = "distil", monitor: str = "none") -> Path:
    """A finished run directory of `method` with the files the flow writes (tiny, made by hand)."""
    run = root / f"run-{method}"
    (run / "data").mkdir(parents=True)
    private = pa.table({"code": [CODES[0]], "text": [f"my visit {SECRET} was awful"]})
    for split in ("train", "validation", "test"):
        pq.write_table(private, run / "data" / f"{split}.parquet")
    (run / "data" / "train.csv").write_text(f"text,label\n{SECRET},Bars\n")
    (run / "config.yaml").write_text(f"name: tiny\ndistill:\n  method: {method}\n")
    for stage in ("data", "teacher", "student", "evaluation"):
        _json(run / stage / "manifest.json", {"stage": stage, "finished_at": "2026-11-21T09:00:00+0000"})

    dp = method in ("dp_sgd", "dpkd")
    teacher_eps = 1.0 if method == "dpkd" else 2.0
    entries = [LedgerEntry(stage="teacher", private=True, epsilon=teacher_eps, delta=1e-3, accountant="prv",
                           mechanism="subsampled_gaussian", noise_multiplier=1.4, sample_rate=0.1, steps=12,
                           max_grad_norm=1.0, privacy_unit="record", history=[(1.4, 0.1, 12)], note="DP-SGD")]
    if not dp:
        entries.insert(0, LedgerEntry(stage="control-codes", private=False, epsilon=None, note="exact counts"))
        entries += [post_processing("generation", "g"), post_processing("distillation", "d")]
    entries.append(post_processing("evaluation", "e"))
    total = LedgerTotal(epsilon=2.0, delta=1e-3, accountant="prv", composition="prv accountant",
                        complete=dp, note="covers the DP stages only" if not dp else "(ε, δ)-DP per record")
    write_ledger(run / "ledger.json", PrivacyLedger(entries=entries, total=total))

    student = f"student_{method}"
    ppl = {"base_student": 800.0, "base_teacher": 750.0, "dp_teacher": 320.0, student: 400.0 + len(method)}
    metrics = {
        "window": 128,
        "test_records": 10,
        "perplexity": {m: {"model": m, "windowed": v, "per_record_mean": v * 0.9, "per_record_median": v * 0.8,
                           "per_record_token_weighted": v * 0.85, "tokens": 2000, "records": 10, "per_code": {},
                           "text_only": {"windowed": v * 1.5, "per_record_mean": v * 1.4, "per_record_median": v * 1.3,
                                         "per_record_token_weighted": v * 1.35, "tokens": 1500, "records": 10,
                                         "per_code": {}}}
                       for m, v in ppl.items()},
        "method": method,
        "seconds": {"data": 0.5, "teacher": 10.0, "evaluation": 2.0},
    }
    del metrics["perplexity"]["base_teacher"]["text_only"]  # as in metrics.json of a run from before issue 37
    if monitor != "none":
        metrics["teacher_validation_loss"] = 6.2
    if method == "dp_sgd":
        del metrics["perplexity"]["base_teacher"], metrics["perplexity"]["dp_teacher"]
    if dp:
        _json(run / "student" / "training_log.json", _dp_log(teacher_eps if method == "dpkd" else 2.0, 4.8, monitor))
    else:
        _json(run / "student" / "training_log.json", {
            "history": [{"step": s, "epoch": 0, "loss": 3 - 0.1 * s, "ce": 5 - 0.1 * s, "kl": 0.3, "mse": 0.0}
                        for s in range(1, 11)],
            "validation": [{"step": 5, "validation_loss": 3.1}, {"step": 10, "validation_loss": 2.9}],
            "stopped_early": False, "seconds": 1.0,
        })
        n = 30
        (run / "synthetic").mkdir()
        pq.write_table(pa.table({
            "sample_id": list(range(n)), "split": ["train"] * (n - 1) + ["validation"],
            "control_code": [CODES[i % 3] for i in range(n)], "text": [SYNTHETIC_TEXT] * n,
            "n_tokens": [8 + i for i in range(n)], "n_prompt_tokens": [6] * n,
            "finished": [i % 2 == 0 for i in range(n)],
        }), run / "synthetic" / "shard-00000.parquet")
        metrics["text_properties"] = {
            "synthetic": {"distinct_1": 0.1, "distinct_2": 0.5, "tokens": {"mean": 16.0, "median": 16.0, "p90": 28.0},
                          "texts": n},
            "real_test": {"distinct_1": 0.2, "distinct_2": 0.6, "tokens": {"mean": 40.0, "median": 30.0, "p90": 90.0},
                          "texts": 10},
        }
        metrics["generation"] = {
            "samples": n, "validation_samples": 1, "dropped_empty": 0, "new_tokens_per_second": 100.0,
            "shards": 1, "resumed_shards": 0,
            "control_codes": {c: {"requested": 1 / 3, "generated": 1 / 3} for c in CODES},
        }
        # What the DP teacher decided on each sample's codes (pipeline/stages/adherence.py): Shopping never requested.
        outcomes = [SampleOutcome({"category": c.split("\t")[0], "stars": c.split("\t")[1]},
                                  {"category": i % 3 != 0, "stars": i % 2 == 0})
                    for i, c in enumerate(CODES[:2] * 5)]
        metrics["code_adherence"] = summarize(
            outcomes, {"category": ["Bars", "Shopping"], "stars": ["Stars: 1.0", "Stars: 3.0", "Stars: 5.0"]},
            truncated=1)
    if method != "dp_sgd":
        _json(run / "teacher" / "training_log.json", _dp_log(teacher_eps, 6.8, monitor))
    _json(run / "metrics.json", metrics)
    return run


def _external_refs(page: str) -> set[str]:
    return set(re.findall(r"https?://[^\s\"'<>)]+", page)) - SVG_NAMESPACES


def test_report_of_a_distil_run_has_every_figure_and_no_private_record(tmp_path):
    run = make_run(tmp_path, "distil")
    path = write_report(run)
    page = path.read_text()
    assert path == run / REPORT
    # DP training (loss + ε), distillation, perplexity, code adherence, lengths
    assert page.count("<svg") == 5
    for title in ("Privacy ledger", "DP-SGD training", "Distillation", "Perplexity per model", "Generation",
                  "Stage timings", "Config"):
        assert f"<h2>{title}</h2>" in page
    assert "could not be drawn" not in page
    assert "student_distil" in page and "requested value scored highest in 60% of 10 samples" in page
    # each model's perplexities on every token and on the text alone (issue 37), a run from before
    # the text-only figures (base_teacher here) with its one row
    section = page[page.index("<h2>Perplexity per model</h2>"):]
    assert section.count("<td>text alone</td>") == 3 and section.count("<td>every token</td>") == 4
    assert "<th>per_record_token_weighted</th>" in section and f"{406.0 * 1.35:.4g}" in section  # student_distil, text alone
    # and on the codes' tokens alone: 2,000 tokens at ln 406, 1,500 of them (the text) at ln 609
    assert section.count("<td>the codes alone</td>") == 3
    codes = math.exp((2000 * math.log(406.0) - 1500 * math.log(406.0 * 1.5)) / 500)
    assert f">{codes:.4g}<" in section and ">500<" in section
    assert "Stars: 5.0" in page and "chance (0.33)" in page and "chance (0.50)" in page
    assert "1 sample(s) had their text cut" in page
    assert "requested vs generated" not in page  # the old chart plotted the prompts against themselves
    assert "covers the DP stages only" in page  # the incomplete total is stated
    assert "15 of 30 samples ended with EOS" in page
    assert f"{2.0:.4g}" in page  # the last ε recorded in the training log
    # self-contained: no script, no stylesheet link, no image source, no URL except SVG namespaces
    assert not re.search(r"<script|<link|<img|src=|@import|url\(http", page)
    assert _external_refs(page) == set()
    assert SECRET not in page and SYNTHETIC_TEXT not in page
    assert not list(run.glob(".report.html.*"))  # the atomic write left no temp file


def test_report_says_the_validation_loss_is_not_monitored_by_default_and_how_to_turn_it_on(tmp_path):
    """teacher.monitor=none: no validation loss anywhere in the report, and a note saying why and
    which setting charts it; with monitor=dp the noisy releases are charted and labelled."""
    page = write_report(make_run(tmp_path / "none", "distil")).read_text()
    assert "validation loss is not monitored" in page and "teacher.monitor=dp" in page
    assert "Validation loss during DP-SGD" not in page and f"{6.8 - 0.05 * 5:.4g}" not in page
    page = write_report(make_run(tmp_path / "dp", "distil", monitor="dp")).read_text()
    assert "Validation loss during DP-SGD" in page and "noisy DP releases" in page
    assert "not monitored" not in page and f"{6.8 - 0.6:.4g}" in page  # the last (final) release


def test_the_dp_training_section_shows_the_replace_one_epsilon_beside_the_add_remove_one(tmp_path):
    """Issue 38 item 6: the ε curve and its table had the add/remove ε only. A training log written
    before (ε alone) still draws, its replace-one cell empty."""
    run = make_run(tmp_path, "distil")
    section = write_report(run).read_text().split("<h2>DP-SGD training</h2>")[1].split("<h2>")[0]
    assert "<th>ε at the end</th><th>replace-one ε at the end</th>" in section
    assert f'<td class="num">{2.0:.4g}</td><td class="num">{3.0:.4g}</td>' in section
    assert "teacher, replace-one" in section  # the dashed curve's legend
    log = json.loads((run / "teacher" / "training_log.json").read_text())
    for h in log["history"]:
        h.pop("epsilon_replace_one", None)
    _json(run / "teacher" / "training_log.json", log)
    section = write_report(run).read_text().split("<h2>DP-SGD training</h2>")[1].split("<h2>")[0]
    assert f'<td class="num">{2.0:.4g}</td><td>-</td>' in section and "teacher, replace-one" not in section


def test_report_is_the_same_for_the_same_run(tmp_path):
    run = make_run(tmp_path, "distil")
    first = write_report(run).read_text()
    assert write_report(run).read_text() == first


@pytest.mark.parametrize("method", ["dp_sgd", "dpkd"])
def test_report_of_a_dp_student_run_skips_generation_with_a_note(tmp_path, method):
    run = make_run(tmp_path, method)
    page = write_report(run).read_text()
    assert page.count("<svg") == 2  # DP training (teacher and/or DP student), perplexity
    assert "DP student" in page
    assert "no distillation" in page and "no generation stage" in page
    assert "could not be drawn" not in page
    assert SECRET not in page


def test_report_of_a_partly_finished_run(tmp_path):
    """Only the config and a finished teacher: the report says what is missing and does not fail."""
    run = make_run(tmp_path, "distil")
    for name in ("metrics.json", "ledger.json"):
        (run / name).unlink()
    for stage in ("synthetic", "student", "evaluation"):
        for f in (run / stage).iterdir():
            f.unlink()
        (run / stage).rmdir()
    page = write_report(run).read_text()
    assert page.count("<svg") == 1  # the teacher's loss and ε
    assert "metrics.json is missing" in page and "No ledger.json yet" in page
    assert "<td>synthetic</td><td>not run</td>" in page and "<td>teacher</td><td>finished</td>" in page
    assert "could not be drawn" not in page


def test_a_broken_part_becomes_a_note_and_the_rest_is_drawn(tmp_path):
    run = make_run(tmp_path, "distil")
    metrics = json.loads((run / "metrics.json").read_text())
    del metrics["perplexity"]["dp_teacher"]["windowed"]
    (run / "metrics.json").write_text(json.dumps(metrics))
    (run / "student" / "training_log.json").write_text('{"history": [')  # a log cut off mid-write
    page = write_report(run).read_text()
    assert "could not be drawn (KeyError)" in page
    assert "No finished distillation log" in page
    assert page.count("<svg") == 3  # DP training, code adherence, lengths


def test_comparison_report_shows_each_methods_student_perplexity(tmp_path):
    runs = {label: make_run(tmp_path, m) for label, m in [("ours", "distil"), ("DP-SGD", "dp_sgd"), ("DPKD", "dpkd")]}
    write_report(runs["ours"])
    runs["not finished"] = tmp_path / "nowhere"
    out = write_comparison_report(runs, tmp_path / "compare.html")
    page = out.read_text()
    assert page.count("<svg") == 1
    for label, value in [("ours", 406.0), ("DP-SGD", 406.0), ("DPKD", 404.0)]:
        assert f"<td>{label}</td>" in page and f"{value:.4g}" in page
    assert "<td>not finished</td>" in page
    assert 'href="run-distil/report.html"' in page  # relative link to the run's own report
    assert _external_refs(page) == set() and SECRET not in page


def _stopped_during(run: Path, stage_dir: str, statuses: dict[str, dict], run_status: str, pid: int) -> None:
    """Make `run` a run that stopped in its last stage of `statuses`: that stage's directory,
    metrics.json and everything after it gone, stages.json and run.json as the flow writes them."""
    (run / "metrics.json").unlink()
    for d in (stage_dir, "synthetic", "student", "evaluation"):
        for f in sorted((run / d).glob("*"), reverse=True):
            f.unlink()
        if (run / d).is_dir():
            (run / d).rmdir()
    _json(run / "stages.json", statuses)
    _json(run / "run.json", {"tool": "dpdistill", "status": run_status, "host": socket.gethostname(), "pid": pid})


def _ran(**extra) -> dict:
    return {"status": "ran", "seconds": 1.5, "finished_at": "2026-11-21T09:00:00"} | extra


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_failed_teacher_is_shown_as_failed_not_as_not_run(tmp_path):
    run = make_run(tmp_path, "distil")
    stages = {"base-models": _ran(), "data": _ran(output=str(run / "data")),
              "control-codes": _ran(), "teacher": {"status": "failed", "seconds": 3.0}}
    _stopped_during(run, "teacher", stages, "failed", os.getpid())
    page = write_report(run).read_text()
    assert "<td>teacher</td><td>failed</td>" in page
    assert "Stage teacher failed" in page and "<td>data</td><td>finished</td>" in page
    assert "not run" not in page and "could not be drawn" not in page


@pytest.mark.parametrize("alive", [True, False])
def test_a_stage_recorded_as_running_is_running_only_while_its_process_is(tmp_path, alive):
    """`dpdistill report` on a run in progress, and on one whose process was killed."""
    run = make_run(tmp_path, "distil")
    stages = {"data": _ran(), "control-codes": _ran(), "teacher": {"status": "running"}}
    _stopped_during(run, "teacher", stages, "running", os.getpid() if alive else _dead_pid())
    assert cli_main(["report", str(run)]) == 0
    page = (run / REPORT).read_text()
    if alive:
        assert "<td>teacher</td><td>running</td>" in page and "interrupted" not in page
    else:
        assert "<td>teacher</td><td>interrupted</td>" in page
        assert "interrupted during stage teacher" in page and "run the same command again" in page


def test_a_cached_stage_says_cached_and_where_its_outputs_are(tmp_path):
    run = make_run(tmp_path, "distil")
    other = tmp_path / "an-earlier-run" / "teacher"
    stages = {"data": _ran(output=str(run / "data")),
              "teacher": {"status": "cached", "seconds": 0.2, "output": str(other)}}
    _json(run / "stages.json", stages)
    page = write_report(run).read_text()
    assert f"<td>teacher</td><td>cached</td><td class=\"num\">0.2</td><td>-</td><td>reused from {other}</td>" in page
    assert "<td>data</td><td>finished</td>" in page and "<td>data</td></tr>" in page  # this run's own: relative


def test_an_unfinished_distil_run_says_generation_has_not_finished(tmp_path):
    """Not that its method has no generation stage: config.yaml says it has one."""
    run = make_run(tmp_path, "distil")
    stages = {"data": _ran(), "control-codes": _ran(), "teacher": _ran(), "generation": {"status": "running"}}
    _stopped_during(run, "synthetic", stages, "running", _dead_pid())
    page = write_report(run).read_text()
    assert "The generation stage has not finished" in page
    assert "no generation stage" not in page


@pytest.mark.skipif(BROWSER is None, reason="no chromium/google-chrome binary (apt-get install chromium)")
def test_wide_tables_stay_inside_the_page_at_1280_px(tmp_path):
    """The 12-column ledger table was 1402 px wide in a 1280 px window: it must scroll inside its
    own box, never widen the page; and no header or number may be cut across lines (issue 24:
    "finishe|d", "epsil|on")."""
    run = make_run(tmp_path, "distil")
    page = write_report(run)
    browser = Chromium(BROWSER)
    try:
        browser.goto(page.as_uri())
        browser.wait_for("Privacy ledger", "noise_multiplier", "method: distil")  # the last section
        deadline = time.monotonic() + 30
        while browser.js("document.readyState") != "complete":  # every table laid out
            assert time.monotonic() < deadline, "report.html did not finish loading in 30 s"
            time.sleep(0.1)
        sizes = browser.js(
            "({page: document.documentElement.scrollWidth, window: window.innerWidth,"
            " body: document.body.getBoundingClientRect().right,"
            " tables: [...document.querySelectorAll('.table-wrap')].map(t => t.getBoundingClientRect().right),"
            # a header or a number laid out on two lines or more (a range has one rect per line)
            " broken: [...document.querySelectorAll('th, td.num')].filter(e => {"
            "   const r = document.createRange(); r.selectNodeContents(e); return r.getClientRects().length > 1;"
            " }).map(e => e.textContent)})"
        )
    finally:
        browser.close()
    assert sizes["window"] == 1280
    assert sizes["page"] <= sizes["window"], sizes
    assert len(sizes["tables"]) == page.read_text().count("<table>") and max(sizes["tables"]) <= sizes["body"], sizes
    assert sizes["broken"] == [], sizes["broken"]  # headers and numbers are never cut ("finishe|d")
