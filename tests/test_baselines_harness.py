"""experiments/baselines.py (issue 37): its tables, Spearman ρ and regret on fabricated jsonl rows,
the schedule of runs and reruns, and the ε each candidate gets so that a row composes to the
same total (bisection on the ledger's composition). No data, no training."""

from __future__ import annotations

import math
import re
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments import baselines  # noqa: E402
from experiments import baselines_report as rep  # noqa: E402


def test_mean_and_sd_are_formatted_as_the_summary_lines_need():
    assert rep.mean_sd([160.0, 162.0, 164.0]) == "162.0±2.0"
    assert rep.mean_sd([180.0]) == "180.0±–"
    assert rep.mean_sd([]) == "–" and rep.mean_sd([None]) == "–"


def _ours(row, k, chosen, tests, kl, private=None, eps=1.987):
    cands = [{"candidate": f"alpha={a}", "alpha": a, "teacher_kl": kl[i], "untruncated_ce": 3.0 + kl[i],
              "synthetic_validation_ce": 2.0 - kl[i], "private_validation": None if private is None else private[i],
              "test_perplexity": tests[i]} for i, a in enumerate((0.0, 0.4, 0.7, 1.0))]
    sel = {"select_by": "private_validation" if private else "teacher_kl", "chosen": chosen, "candidates": cands,
           "private_validation": {"epsilon": 0.2} if private else None}
    student = next(c["test_perplexity"] for c in cands if c["candidate"] == chosen)
    return {"kind": "run", "row": row, "candidate": None, "repeat": k, "student": student, "epsilon": eps,
            "seconds": 3000.0, "selection": sel}


def _dp(row, k, values, eps=1.987):
    names = ("a", "b", "c", "d")
    return [{"kind": "run", "row": row, "candidate": n, "repeat": k, "student": v, "epsilon": eps, "seconds": 400.0}
            for n, v in zip(names, values)]


def _fabricated() -> list[dict]:
    # ours r1: the rule (teacher_kl) picks α=1 (170), the best is α=0.4 (160): regret 10, ρ 0.2
    # ours r2: it picks α=1 (150), the best: regret 0, ρ 1
    out = [_ours("ours", 1, "alpha=1.0", [200.0, 160.0, 165.0, 170.0], [0.9, 0.6, 0.5, 0.1]),
           _ours("ours", 2, "alpha=1.0", [200.0, 180.0, 170.0, 150.0], [0.9, 0.6, 0.5, 0.1]),
           _ours("ourspriv", 1, "alpha=0.4", [205.0, 165.0, 168.0, 175.0], [0.9, 0.6, 0.5, 0.1],
                 private=[5.3, 5.0, 5.1, 5.2], eps=1.9869)]
    out += _dp("dpsgd", 1, [190.0, 180.0, 185.0, 200.0]) + _dp("dpsgd", 2, [192.0, 184.0, 186.0, 201.0])
    out += _dp("dpsgd", 3, [191.0, 181.0])  # an unfinished repeat: not in the oracle
    out += _dp("dpsgddep", 1, [210.0, 200.0, 205.0, 220.0], eps=0.9)
    out.append({"kind": "selection", "row": "dpsgddep", "repeat": 1, "chosen": "c", "selection_epsilon": 0.2,
                "epsilon": 1.986, "seconds": 60.0, "scores": {"a": 5.4, "b": 5.2, "c": 5.1, "d": 5.6}})
    return out


def test_oracle_deployable_rule_and_the_summary_lines_on_fabricated_rows():
    results = _fabricated()
    assert [(v["repeat"], v["value"], v["candidate"]) for v in rep.oracle(results, "ours")] == [
        (1, 160.0, "alpha=0.4"), (2, 150.0, "alpha=1.0")]
    assert [v["value"] for v in rep.oracle(results, "dpsgd")] == [180.0, 184.0]
    assert rep.oracle(results, "dpkd") == []
    dep = rep.deployable(results, "dpsgd", private=True)
    assert [(d["value"], d["chosen"], d["selection_epsilon"], d["epsilon"]) for d in dep] == [(205.0, "c", 0.2, 1.986)]
    assert [d["selection_epsilon"] for d in rep.deployable(results, "ours", private=False)] == [0.0, 0.0]
    assert [d["value"] for d in rep.deployable(results, "ours", private=True)] == [165.0]

    rule = rep.rule_study(results)
    assert [r["regret"] for r in rule] == [10.0, 0.0]
    assert rule[0]["spearman"] == pytest.approx(0.2) and rule[1]["spearman"] == pytest.approx(1.0)
    private = rep.rule_study(results, "ours", private=True)
    assert private[0]["regret"] == 0.0 and private[0]["spearman"] == pytest.approx(1.0)
    dp = rep.rule_study(results, "dpsgd", private=True)
    assert dp[0]["regret"] == pytest.approx(5.0) and dp[0]["spearman"] == pytest.approx(0.8)
    # How another criterion would have chosen: synthetic_validation_ce = 2 - teacher_kl prefers α=0
    other = rep.rule_study(results, criterion="synthetic_validation_ce")
    assert [r["chosen"] for r in other] == ["alpha=0.0", "alpha=0.0"] and [r["regret"] for r in other] == [40.0, 50.0]

    lines = rep.report(results, "airline").strip().splitlines()
    assert lines[-3:] == ["table=oracle corpus=airline ours=155.0±7.1 dpsgd=182.0±2.8 dpkd=–",
                          "table=deployable corpus=airline ours=160.0±14.1 dpsgd=205.0±– dpkd=–",
                          "rule corpus=airline candidates=4 spearman=0.60 regret=5.0"]
    assert "private corpus=airline method=ours candidates=4 spearman=1.00 regret=0.0" in lines
    assert "private corpus=airline method=dpsgd candidates=4 spearman=0.80 regret=5.0" in lines
    assert "table=deployable-private corpus=airline ours=165.0±– dpsgd=205.0±– dpkd=–" in lines
    wall = next(line for line in lines if line.startswith("wall "))
    assert wall == "wall corpus=airline runs=17 selections=1 seconds=14660 hours=4.1"
    text = "\n".join(lines)
    assert "| dpsgd | 10 | 400, 400" in text and "| dpsgddep | 4 | 400, 400, 400, 400 | 400 |" in text
    assert "| private choices | 1 | 60 | 60 |" in text


def test_the_choices_on_training_and_validation_records_are_rows_of_their_own():
    """A second private choice of the same candidates (distill.selection_split=train+validation):
    its own deployable rows and ρ lines; the first choice's rows and lines are unchanged. For
    ours it chooses among ourspriv's kept candidates, whose test figures its run recorded."""
    results = _fabricated()
    before = rep.report(results, "airline")
    assert "training + validation" not in before and "trainval" not in before
    results += [{"kind": "selection", "row": "dpsgddep", "repeat": 1, "split": "train+validation", "chosen": "b",
                 "selection_epsilon": 0.2, "epsilon": 1.986, "seconds": 90.0,
                 "scores": {"a": 5.3, "b": 5.0, "c": 5.1, "d": 5.6}},
                {"kind": "selection", "row": "ourspriv", "repeat": 1, "split": "train+validation",
                 "chosen": "alpha=0.7", "selection_epsilon": 0.2, "epsilon": 1.9869, "seconds": 80.0,
                 "scores": {"alpha=0.0": 5.9, "alpha=0.4": 5.2, "alpha=0.7": 5.1, "alpha=1.0": 5.3}}]
    assert [d["value"] for d in rep.deployable(results, "dpsgd", True)] == [205.0]  # the first choice's
    assert [(d["value"], d["chosen"]) for d in rep.deployable(results, "dpsgd", True, split="train+validation")] == [
        (200.0, "b")]
    assert [(d["value"], d["chosen"]) for d in rep.deployable(results, "ours", True, split="train+validation")] == [
        (168.0, "alpha=0.7")]
    [ours] = rep.rule_study(results, "ours", private=True, split="train+validation")
    assert ours["regret"] == pytest.approx(3.0) and ours["spearman"] == pytest.approx(0.8)
    lines = rep.report(results, "airline").strip().splitlines()
    assert "table=deployable-private-trainval corpus=airline ours=168.0±– dpsgd=200.0±– dpkd=–" in lines
    assert "private-trainval corpus=airline method=dpsgd candidates=4 spearman=1.00 regret=0.0" in lines
    assert "table=deployable-private corpus=airline ours=165.0±– dpsgd=205.0±– dpkd=–" in lines
    assert any(line.startswith("| DP-SGD (private selection, training + validation) | 1 | 200.0±–") for line in lines)


def test_on_the_text_alone_the_tables_and_the_rule_use_the_text_only_figures():
    """The header flips the ranking (as on SmolLM2's airline tweets): α = 0.4 wins windowed by
    predicting the control-code header, α = 1 (the rule's choice) wins on the text alone."""
    results = _fabricated()
    for r in results:
        if r.get("selection"):
            for c in r["selection"]["candidates"]:  # text alone: the windowed order reversed for α > 0
                c["test_text_perplexity"] = 500.0 if c["alpha"] == 0.0 else 400.0 - c["test_perplexity"]
            chosen = r["selection"]["chosen"]
            r["student_text_windowed"] = next(c["test_text_perplexity"] for c in r["selection"]["candidates"]
                                              if c["candidate"] == chosen)
        elif r.get("kind") == "run":
            r["student_text_windowed"] = r["student"] + 30.0
    assert [(v["value"], v["candidate"]) for v in rep.oracle(results, "ours", figure="text")] == [
        (230.0, "alpha=1.0"), (220.0, "alpha=0.4")]
    assert [v["value"] for v in rep.oracle(results, "dpsgd", figure="text")] == [210.0, 214.0]
    assert [d["value"] for d in rep.deployable(results, "dpsgd", True, "text")] == [235.0]
    rule = rep.rule_study(results, figure="text")
    assert [r["regret"] for r in rule] == [0.0, 30.0]
    lines = rep.report(results, "airline").strip().splitlines()
    assert "table=oracle-text corpus=airline ours=225.0±7.1 dpsgd=212.0±2.8 dpkd=–" in lines
    assert "rule-text corpus=airline candidates=4 spearman=0.60 regret=15.0" in lines
    assert lines[-1].startswith("rule corpus=airline")  # the three lines stay last
    assert "table=oracle-record corpus=airline ours=– dpsgd=– dpkd=–" in lines  # not recorded here
    # a run recorded before the text-only figures is left out of those tables, not failed
    del results[0]["selection"]["candidates"][0]["test_text_perplexity"]
    assert [v["repeat"] for v in rep.oracle(results, "ours", figure="text")] == [2]


def test_the_report_of_no_results_still_ends_with_the_three_lines():
    lines = rep.report([], "yelp").strip().splitlines()
    assert lines[-1] == "rule corpus=yelp candidates=4 spearman=– regret=–"
    assert lines[-3] == "table=oracle corpus=yelp ours=– dpsgd=– dpkd=–"


def _teacher(lr=0.003, epochs=2):
    return SimpleNamespace(teacher=SimpleNamespace(learning_rate=lr, epochs=epochs))


def test_every_method_gets_k_candidates_and_dpkd_candidates_share_a_teacher_by_learning_rate():
    cfg = _teacher()
    dpsgd = baselines.candidates(cfg, "dpsgd")
    assert [c.name for c in dpsgd] == ["lr=0.003,epochs=2", "lr=0.003,epochs=6", "lr=0.009,epochs=2",
                                       "lr=0.009,epochs=6"]
    dpkd = baselines.candidates(cfg, "dpkddep")
    assert [c.name for c in dpkd] == ["alpha=0.4,lr=0.003", "alpha=1.0,lr=0.003", "alpha=0.4,lr=0.009",
                                      "alpha=1.0,lr=0.009"]
    assert len(dpsgd) == len(dpkd) == len(baselines.OURS_ALPHAS) == rep.K
    assert "distill.candidates=[{alpha: 0.0}, {alpha: 0.4}, {alpha: 0.7}, {alpha: 1.0}]" in \
        baselines.row_overrides("ours", 0.2)
    assert "distill.select_by=private_validation" in baselines.row_overrides("ourspriv", 0.2)


def test_the_k2_grid_is_the_one_docs_real_model_md_fixed_before_any_run():
    grid = baselines.GRIDS["k2"]
    cfg = _teacher(lr=0.0005, epochs=1)  # configs/smollm2_*.yaml's teacher section
    assert [c.name for c in baselines.candidates(cfg, "dpsgd", grid)] == ["lr=0.0005,epochs=1", "lr=0.002,epochs=1"]
    assert [c.name for c in baselines.candidates(cfg, "dpkd", grid)] == ["alpha=0.4,lr=0.0005", "alpha=1.0,lr=0.0005"]
    assert "distill.candidates=[{alpha: 0.4}, {alpha: 1.0}]" in baselines.row_overrides("ours", 0.2, grid)
    items = baselines.schedule(cfg, list(baselines.ROWS), 1, {row: 1.0 for row in baselines.ROWS}, 0.2, grid)
    runs = [i for i in items if isinstance(i, baselines.Run)]
    assert grid.k == 2 and len(runs) == 1 + 1 + 4 * grid.k
    # both DPKD candidates have one learning rate: the second reuses the first's teacher
    assert [r.shares_teacher for r in runs if r.row == "dpkd"] == [False, True]


def test_the_schedule_reruns_the_noisy_stage_of_every_later_repeat():
    eps = {row: 1.0 for row in baselines.ROWS}
    items = baselines.schedule(_teacher(), list(baselines.ROWS), 2, eps, 0.2)
    runs = [i for i in items if isinstance(i, baselines.Run)]
    # each repeat: a choice per SHARED row and split, and ourspriv's second (its run made the first)
    assert len(runs) == 2 * (1 + 1 + 4 * rep.K) and len(items) - len(runs) == 2 * (2 * len(baselines.SHARED) + 1)
    assert all(r.noisy_stage is None for r in runs if r.repeat == 1)
    second = {r.tag: r.noisy_stage for r in runs if r.repeat == 2}
    assert second["ours-r2"] == second["ourspriv-r2"] == "control-codes"
    assert {second[f"dpsgd-c{i}-r2"] for i in range(1, 5)} == {"dp-student"}
    # DPKD: the first candidate of each learning rate draws a teacher, the second reuses it
    assert [second[f"dpkd-c{i}-r2"] for i in range(1, 5)] == ["teacher", "dp-student", "teacher", "dp-student"]
    # a choice follows its row's candidates, in each repeat
    at = items.index(baselines.Choice("dpsgddep", 1))
    assert [i.tag for i in items[at - 4:at]] == [f"dpsgddep-c{i}-r1" for i in range(1, 5)]
    assert items[at + 1] == baselines.Choice("dpsgddep", 1, "train+validation")
    assert items[items.index(baselines.Choice("ourspriv", 2, "train+validation")) - 1].tag == "ourspriv-r2"
    assert baselines.Choice("ourspriv", 1) not in items  # the ourspriv run chose on the validation split itself
    # a line from before the second split counts as the validation split's choice, and only as that
    old = [{"kind": "selection", "row": "dpsgddep", "repeat": 1, "chosen": "c"}]
    assert baselines._done(old, baselines.Choice("dpsgddep", 1))
    assert not baselines._done(old, baselines.Choice("dpsgddep", 1, "train+validation"))
    assert "teacher.target_epsilon=1" in runs[0].overrides


def _dp_sgd_entry(stage: str, epsilon: float, epochs: int = 1):
    """A DP-SGD release as the plan makes it: σ calibrated by the accountant for `epsilon`."""
    from pipeline.config import TeacherConfig
    from pipeline.privacy.dpsgd import plan_dp_sgd
    from pipeline.privacy.ledger import LedgerEntry

    dp = plan_dp_sgd(TeacherConfig(batch_size=50, epochs=epochs, accountant="rdp", target_delta=1e-5), 1000,
                     "record", epsilon)
    return LedgerEntry(stage=stage, private=True, epsilon=epsilon, delta=dp.delta, accountant="rdp",
                       mechanism="subsampled_gaussian", noise_multiplier=dp.sigma, sample_rate=dp.sample_rate,
                       privacy_unit="record",
                       steps=dp.steps_allowed, history=[(dp.sigma, dp.sample_rate, dp.steps_allowed)], note="planned")


def test_bisection_finds_the_largest_x_whose_total_stays_within_the_target():
    steps = lambda x: math.floor(x * 64) / 64  # noqa: E731  a total that moves on a grid, as σ's calibration does
    x = baselines.bisect(lambda x: 2 * steps(x), 1.0, 0.1, 4.0, tol=1e-3)
    assert 2 * steps(x) <= 1.0 and x == pytest.approx(0.5, abs=1 / 64)
    assert baselines.bisect(lambda x: x, 10.0, 0.1, 4.0) == 4.0  # the whole bracket fits
    with pytest.raises(ValueError, match="composes past"):
        baselines.bisect(lambda x: x, 0.05, 0.1, 4.0)


def test_each_candidate_gets_the_epsilon_at_which_k_runs_and_the_choice_compose_to_the_total():
    """Four DP-SGD candidates (two of them with twice the steps) and the private choice among
    them, composed by the ledger's accountant, come to the target at the ε bisection finds."""
    from pipeline.privacy.ledger import compose

    target = 2.0
    cands = baselines.candidates(_teacher(), "dpsgddep")
    choice = baselines.selection_release(0.2, 1e-5, len(cands), "rdp", 500, "record")

    def total(x):
        planned = [(c, [_dp_sgd_entry("dp-student", x, epochs=1 + i % 2)]) for i, c in enumerate(cands)]
        return compose(baselines.unique_releases(planned) + [choice], "rdp", 1e-5).epsilon

    x = baselines.bisect(total, target, 0.5, target, tol=0.02)
    assert target / 4 < x < target  # four trainings and a choice share what one would have had
    assert target - 0.02 <= total(x) <= target


def test_a_teacher_dpkd_candidates_share_is_one_release():
    cands = baselines.candidates(_teacher(), "dpkddep")
    planned = [(c, [_dp_sgd_entry("teacher", 1.0), _dp_sgd_entry("dp-student", 1.0)]) for c in cands]
    stages = [e.stage for e in baselines.unique_releases(planned)]
    assert stages.count("teacher") == 2 and stages.count("dp-student") == 4
    assert len(baselines.unique_releases(planned[:1])) == 2
    # the finished runs' actual teachers: a candidate that trained its own (cache miss) is one more release
    teachers = {c.name: f"runs/{c.teacher}" for c in cands}
    assert [e.stage for e in baselines.unique_releases(planned, teachers)].count("teacher") == 2
    teachers[cands[1].name] = "runs/its-own-teacher"
    assert [e.stage for e in baselines.unique_releases(planned, teachers)].count("teacher") == 3


def test_without_its_data_the_harness_exits_in_one_line(tmp_path):
    missing = tmp_path / "shared" / "data" / "airline-tweets" / "tweets.csv"
    env = {**os.environ, "DPDISTILL_SHARED": str(tmp_path / "shared"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "experiments/baselines.py", "--config", "configs/airline.yaml", "--plan",
                           f"data.path={missing}", f"run_root={tmp_path / 'runs'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"experiments/baselines.py: data.path {missing}")
    assert not (tmp_path / "runs").exists()


def test_refresh_rederives_the_selection_figures_from_the_run_directory(tmp_path):
    """`--refresh`: figures the report learned to show after a run was recorded (the text-alone
    and per-record ones) are read again from the run's metrics.json."""
    import json

    from experiments.shared import append_result, read_results, refresh_selections

    run = tmp_path / "airline-ours-r1-20261126-023825"
    run.mkdir()
    metrics = {"selection": {"select_by": "teacher_kl", "chosen": "alpha=1.0", "candidates": [
        {"candidate": "alpha=0.4", "teacher_kl": 0.4, "test_perplexity": 87.0},
        {"candidate": "alpha=1.0", "teacher_kl": 0.2, "test_perplexity": 81.8}]},
        "perplexity": {"candidate alpha=0.4": {"windowed": 87.0, "per_record_token_weighted": 43.3,
                                               "text_only": {"windowed": 213.9}},
                       "student_distil": {"windowed": 81.8, "per_record_token_weighted": 40.0,
                                          "text_only": {"windowed": 192.9}}}}
    (run / "metrics.json").write_text(json.dumps(metrics))
    path = tmp_path / "baselines.jsonl"
    old = {"kind": "run", "row": "ours", "repeat": 1, "run_dir": str(run), "student": 81.8,
           "selection": {"chosen": "alpha=1.0", "candidates": [{"candidate": "alpha=0.4", "test_perplexity": 87.0}]}}
    append_result(path, old)
    assert refresh_selections(path) == 1 and refresh_selections(path) == 0
    (row,) = read_results(path, "airline")
    assert [(c["test_text_perplexity"], c["test_per_record_token_weighted"]) for c in row["selection"]["candidates"]] \
        == [(213.9, 43.3), (192.9, 40.0)]


def test_ours_row_is_taken_from_the_confirmation_only_where_it_ran_the_grid(tmp_path):
    """`--ours-from`: the confirmation's ours runs (α 0.4 and 1 under the rule, each scored) are the
    k2 grid's ours row, and the report's oracle and deployable rows read them; runs of other
    candidates, another rule or unscored candidates are refused, naming the run."""
    import json

    from experiments.shared import append_result, read_results

    def confirmation(k, tests, chosen, select_by="teacher_kl", alphas=(0.4, 1.0)):
        cands = [{"candidate": f"alpha={a}", "alpha": a, "test_perplexity": t} for a, t in zip(alphas, tests)]
        return {"config": "smollm2-yelp", "row": "ours", "repeat": k, "seconds": 5900.0, "epsilon": 1.986,
                "delta": 5e-5, "student": tests[alphas.index(float(chosen.split("=")[1]))],
                "selection": {"select_by": select_by, "chosen": chosen, "candidates": cands}}

    source, study = tmp_path / "confirmation.jsonl", tmp_path / "baselines.jsonl"
    for line in (confirmation(1, [210.3, 203.7], "alpha=1.0"), confirmation(2, [196.0, 199.0], "alpha=1.0"),
                 {"config": "smollm2-yelp", "row": "DP-SGD", "repeat": 1, "student": 370.6},
                 {**confirmation(1, [80.0, 79.0], "alpha=1.0"), "config": "smollm2-airline"}):
        append_result(source, line)
    k2 = baselines.GRIDS["k2"]
    assert baselines.take_ours(study, source, "smollm2-yelp", k2) == 2
    assert baselines.take_ours(study, source, "smollm2-yelp", k2) == 0  # once
    rows = read_results(study, "smollm2-yelp")
    assert [(r["kind"], r["row"], r["candidate"], r["repeat"]) for r in rows] == [("run", "ours", None, 1),
                                                                                  ("run", "ours", None, 2)]
    assert [x["value"] for x in rep.oracle(rows, "ours", k=2)] == [203.7, 196.0]
    assert [x["value"] for x in rep.deployable(rows, "ours", private=False)] == [203.7, 199.0]
    # runs and a choice transcribed from the docs, without their seconds or noisy scores, still report
    transcribed = [{"kind": "run", "row": "dpsgddep", "candidate": c, "repeat": 1, "student": v, "epsilon": 1.56}
                   for c, v in (("lr=0.0005,epochs=1", 373.1), ("lr=0.002,epochs=1", 286.2))]
    transcribed.append({"kind": "selection", "row": "dpsgddep", "repeat": 1, "chosen": "lr=0.002,epochs=1",
                        "selection_epsilon": 0.2, "epsilon": 1.98})
    text = rep.report(rows + transcribed, "smollm2-yelp", 2)
    assert "table=deployable corpus=smollm2-yelp ours=201.3±3.3 dpsgd=286.2±– dpkd=–" in text
    assert "| dpsgddep | 2 | –, – | – |" in text
    for bad, why in ((confirmation(3, [1.0, 2.0], "alpha=1.0", select_by="untruncated_ce"), "untruncated_ce"),
                     (confirmation(3, [1.0, 2.0], "alpha=1.0", alphas=(0.0, 1.0)), "[0.0, 1.0]"),
                     (confirmation(3, [1.0, None], "alpha=0.4"), "not all scored")):
        other = tmp_path / f"bad-{why}.jsonl"
        other.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match="ours run 3 .*" + re.escape(why)):
            baselines.take_ours(study, other, "smollm2-yelp", k2)
    with pytest.raises(ValueError, match="ours run 1"):  # the k4 grid's ours row is not the confirmation's
        baselines.take_ours(tmp_path / "k4.jsonl", source, "smollm2-yelp", baselines.GRIDS["k4"])
