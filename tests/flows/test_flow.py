"""End to end: the real Prefect flow on a tiny config, its run directory and its artifacts."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from conftest import YELP_DOMAIN
from flows.artifacts import ADHERENCE_KEY, LEDGER_KEY, METRICS_KEY, SELECTION_KEY, SUMMARY_KEY
from flows.cli import main
from flows.pipeline_flow import dp_distill
from pipeline.records import read_split
from pipeline.privacy.ledger import read_ledger


def test_flow_end_to_end(prefect_server, tiny_config):
    """The flow writes the run directory and publishes the ledger and metrics artifacts."""
    tiny_config.data.keep_private_copies = True  # the leak check below reads the splits
    tiny_config.distill.candidates = [{"alpha": 0.4}, {"alpha": 1.0}]  # the selection and its artifact, end to end
    state = dp_distill(tiny_config, return_state=True)
    assert state.is_completed()
    run = Path(state.result())
    for name in ("config.yaml", "ledger.json", "metrics.json"):
        assert (run / name).is_file(), name
    for stage in ("data", "teacher", "synthetic", "student"):
        assert (run / stage / "manifest.json").is_file(), stage
    assert (run / "teacher" / "model" / "model.safetensors").is_file()
    assert (run / "student" / "model" / "model.safetensors").is_file()
    # The split key (issue 23) stays in the run root, 0600; no file of the run holds it.
    key_file = Path(tiny_config.run_root) / ".split-key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    key = key_file.read_bytes()
    assert not [f for f in run.rglob("*") if f.is_file() and (key in (b := f.read_bytes()) or key.hex().encode() in b)]

    typed = read_ledger(run / "ledger.json")
    ledger = {e.stage: e for e in typed.entries}
    assert list(ledger) == ["control-codes", "teacher", "generation", "distillation", "evaluation"]
    teacher = ledger["teacher"]
    assert 0 < teacher.epsilon <= tiny_config.teacher.target_epsilon
    assert teacher.accountant == "prv" and teacher.steps > 0 and teacher.noise_multiplier > 0
    codes = ledger["control-codes"]
    assert codes.private and codes.mechanism == "gaussian" and 0 < codes.epsilon <= 1.0
    assert all(ledger[s].epsilon == 0 for s in ("generation", "distillation", "evaluation"))
    # The total composes both Gaussian mechanisms through the accountant (not by adding ε's).
    total = typed.total
    assert total.complete and max(teacher.epsilon, codes.epsilon) < total.epsilon < teacher.epsilon + codes.epsilon
    assert teacher.epsilon_rdp >= teacher.epsilon * 0.9  # RDP cross-check beside PRV

    metrics = json.loads((run / "metrics.json").read_text())
    assert set(metrics["perplexity"]) == {"base_student", "base_teacher", "dp_teacher", "student_distil"}
    assert all(m["windowed"] > 1 for m in metrics["perplexity"].values())
    per_record = metrics["seconds_per_training_record"]["teacher"]  # issue 22: the teacher's time per record
    assert per_record == pytest.approx(metrics["seconds"]["teacher"] / tiny_config.data.max_records, rel=0.2)
    # aggregates only: per control code (small codes pooled), and text properties
    assert all(v > 1 for m in metrics["perplexity"].values() for v in m["per_code"].values())
    props = metrics["text_properties"]
    assert 0 < props["synthetic"]["distinct_1"] <= 1 and props["synthetic"]["texts"] == props["real_test"]["texts"] == 20
    synthetic = pq.read_table(run / "synthetic" / "shard-00000.parquet")
    assert synthetic.num_rows + metrics["generation"]["dropped_empty"] == tiny_config.generate.num_samples
    # The DP teacher's choice among each column's declared values, on the synthetic training samples.
    adherence = metrics["code_adherence"]
    assert adherence["samples"] + adherence["skipped"] == synthetic["split"].to_pylist().count("train")
    assert set(adherence["columns"]) == set(tiny_config.data.code_columns)
    for column, values in YELP_DOMAIN.items():
        result = adherence["columns"][column]
        assert 0 <= result["share"] <= 1 and result["chance"] == pytest.approx(1 / len(values))
        assert list(result["values"]) == values and sum(v["n"] for v in result["values"].values()) == result["n"]
    assert 0 <= adherence["all_columns"] <= adherence["overall"] <= 1  # every column scored on every sample
    # The student was chosen among the candidates by the default post-processing criterion (issue 20),
    # and a classifier trained on the synthetic text was tested on the real test split's codes.
    selection = metrics["selection"]
    assert [r["candidate"] for r in selection["candidates"]] == ["alpha=0.4", "alpha=1.0"]
    assert selection["select_by"] == "teacher_kl" and selection["chosen"] in ("alpha=0.4", "alpha=1.0")
    chosen = next(r for r in selection["candidates"] if r["candidate"] == selection["chosen"])
    assert chosen["test_perplexity"] == metrics["perplexity"]["student_distil"]["windowed"]
    assert all(r["teacher_kl"] > 0 for r in selection["candidates"])
    assert set(metrics["downstream"]["columns"]) == set(tiny_config.data.code_columns)

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]))
        )
    by_key = {a.key: a for a in artifacts}
    assert {LEDGER_KEY, SUMMARY_KEY, METRICS_KEY, ADHERENCE_KEY, SELECTION_KEY} <= set(by_key)
    assert by_key[LEDGER_KEY].type == "table" and by_key[METRICS_KEY].type == "table"
    ledger_rows = json.loads(by_key[LEDGER_KEY].data) if isinstance(by_key[LEDGER_KEY].data, str) else by_key[LEDGER_KEY].data
    assert [r["stage"] for r in ledger_rows] == [*ledger, "TOTAL"]

    # No artifact carries a private record (train or test), not even a 40-character piece.
    published = " ".join(str(a.data) + str(a.description) for a in artifacts)
    for split in ("train", "validation", "test"):
        for text in read_split(run / "data" / f"{split}.parquet")[1]:
            piece = text.strip()[:40]
            assert len(piece) < 20 or piece not in published

    _private_selection_run(tiny_config)


def _private_selection_run(cfg):
    """distill.select_by=private_validation through the flow, on the same run root (data, codes,
    teacher and synthetic data come from the cache): the candidates' noisy scores on the validation
    and training records are a ledger entry after the distillation, composed by the accountant with the codes' and the
    teacher's releases, charged to the dataset's budget and explained in the report."""
    from pipeline.privacy.accountant import epsilon_of
    from pipeline.privacy.budget import read_budget
    from pipeline.privacy.private_selection import STAGE

    cfg = cfg.model_copy(deep=True)
    cfg.distill.select_by, cfg.distill.selection_epsilon = "private_validation", 0.5
    run = Path(dp_distill(cfg))
    ledger = read_ledger(run / "ledger.json")
    assert [e.stage for e in ledger.entries] == ["control-codes", "teacher", "generation", "distillation", STAGE,
                                                 "evaluation"]
    released = ledger.entry(STAGE)
    assert released.private and released.history[0][1:] == (1.0, 2) and 0 < released.epsilon <= 0.5 + 1e-6
    joint = [h for e in ledger.entries if e.history for h in e.history]
    assert ledger.total.epsilon == pytest.approx(epsilon_of("prv", joint, released.delta))
    assert ledger.total.epsilon > max(e.epsilon or 0 for e in ledger.entries)
    selection = json.loads((run / "metrics.json").read_text())["selection"]
    assert selection["select_by"] == "private_validation"
    assert selection["chosen"] == min(selection["candidates"], key=lambda r: r["private_validation"])["candidate"]
    records_id = json.loads((run / "run.json").read_text())["records_id"]
    budget = read_budget(Path(cfg.run_root).resolve(), records_id)
    assert sorted(r.stage for r in budget.releases) == ["control-codes", STAGE, "teacher"]  # once each
    assert "PRIVATE validation and training splits" in (run / "report.html").read_text()
    assert "validation and training records" in released.note and selection["private_validation"]["units"] > 20


def test_cli_ledger_show_prints_the_table(tmp_path, capsys):
    """`dpdistill ledger show RUN_DIR` prints every stage and the total."""
    from pipeline.privacy.ledger import PrivacyLedger, compose, post_processing, write_ledger
    from pipeline.privacy.ledger import LedgerEntry

    teacher = LedgerEntry(
        stage="teacher", private=True, epsilon=1.5, delta=1e-3, accountant="prv", mechanism="subsampled_gaussian",
        noise_multiplier=1.0, sample_rate=0.1, steps=30, max_grad_norm=1.0, privacy_unit="record",
        history=[(1.0, 0.1, 30)], note="DP-SGD",
    )
    entries = [teacher, post_processing("generation", "samples")]
    write_ledger(tmp_path / "ledger.json", PrivacyLedger(entries=entries, total=compose(entries, "prv", 1e-3)))
    assert main(["ledger", "show", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "teacher" in out and "generation" in out and "TOTAL" in out and "prv accountant" in out
    assert main(["ledger", "show", str(tmp_path / "nope")]) == 2


def test_cli_reports_config_errors_and_exits_2(tmp_path, capsys):
    """A bad override stops before any work with exit code 2 and a message naming the field."""
    code = main(["run", "--config", "configs/demo.yaml", "teacher.target_epsilon=-1", "teacher.epsilonn=3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "teacher.target_epsilon = -1" in err and "teacher.epsilonn" in err


@pytest.mark.parametrize("method", ["dp_syn", "dp_sgd", "dpkd", "public_only"])
def test_baselines_run_through_the_same_flow(prefect_server, tmp_path, method):
    """Each baseline is one config switch; its ledger lists exactly the stages that touched
    private data, with their ε, and the total composes them."""
    from conftest import tiny_pipeline_dict
    from pipeline.config import config_from_dict

    tree = tiny_pipeline_dict(tmp_path)
    tree["distill"]["method"] = method
    cfg = config_from_dict(tree)
    run = Path(dp_distill(cfg))
    typed = read_ledger(run / "ledger.json")
    stages = [e.stage for e in typed.entries]
    eps = cfg.teacher.target_epsilon
    metrics = json.loads((run / "metrics.json").read_text())
    assert f"student_{method}" in metrics["perplexity"] and "base_student" in metrics["perplexity"]
    if method == "dp_syn":
        assert stages == ["control-codes", "teacher", "generation", "distillation", "evaluation"]
        log = json.loads((run / "student" / "training_log.json").read_text())
        assert all(h["kl"] == 0 or h["loss"] == pytest.approx(h["ce"]) for h in log["history"])
    elif method == "dp_sgd":
        assert stages == ["dp-student", "evaluation"]
        student = typed.entry("dp-student")
        assert student.epsilon <= eps and student.epsilon > 0.9 * eps
        assert typed.total.complete and typed.total.epsilon == pytest.approx(student.epsilon)
        assert not (run / "synthetic").exists()
    elif method == "public_only":  # the ε = 0 control: the base teacher writes, from public prompts
        assert stages == ["control-codes", "generation", "distillation", "evaluation"]
        assert typed.total.complete and typed.total.epsilon == 0 and typed.entry("control-codes").mechanism == "public"
        assert not (run / "teacher").exists() and "dp_teacher" not in metrics["perplexity"]
        assert "base_teacher" in metrics["perplexity"]
        counts = json.loads((run / "control_codes" / "control_codes.json").read_text())["counts"]
        assert len(counts) == len(YELP_DOMAIN["label1"]) * len(YELP_DOMAIN["label2"])
        assert set(counts.values()) == {1.0}
        # No stage after the split read a private split: none names one among its inputs, and the
        # records' budget holds no release.
        outputs = json.loads((run / "data" / "manifest.json").read_text())["outputs"]
        splits = [json.dumps(outputs[s]["sha256"]) for s in ("train", "validation")]
        for stage in ("control_codes", "synthetic", "student"):
            manifest = (run / stage / "manifest.json").read_text()
            assert not [s for s in splits if s in manifest], stage
        from pipeline.privacy.budget import read_budget
        info = json.loads((run / "run.json").read_text())
        assert not read_budget(Path(cfg.run_root).resolve(), info["records_id"]).releases
    else:  # dpkd: two equal shares that the accountant composes to the run's ε
        assert stages == ["teacher", "dp-student", "evaluation"]
        t, s = typed.entry("teacher"), typed.entry("dp-student")
        assert eps / 2 < t.epsilon == s.epsilon < eps and "KD loss" in s.note
        assert typed.total.complete and eps - 0.02 <= typed.total.epsilon <= eps


def _counting(monkeypatch, owner, name: str, calls: list) -> None:
    """Count the calls of `owner.name`, and of it under any name a module of ours imported it by."""
    import sys

    real = getattr(owner, name)

    def counted(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(result)
        return result

    monkeypatch.setattr(owner, name, counted)
    for module in [m for n, m in sys.modules.items() if n.split(".")[0] in ("flows", "pipeline")]:
        if getattr(module, name, None) is real:
            monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize("method", ["distil", "dpkd"])
def test_the_flow_plans_once_and_hands_each_dp_sgd_stage_its_plan(prefect_server, tmp_path, monkeypatch, method):
    """Issue 39: the plan the run logs at its start is its only one (privacy.max_epsilon's checks
    included), and each DP-SGD stage trains with its σ, q, steps and δ, calibrated once: σ is the
    one the stage would calibrate itself for its share of the budget (DPKD: equal shares that
    compose to the run's ε). The distillation's candidates, built when the config was validated,
    are read once, by the stage, which trains and selects with them; a DP-SGD student never reads them."""
    from conftest import tiny_pipeline_dict
    from pipeline import plan as plan_module
    from pipeline.config import DistillConfig, config_from_dict
    from pipeline.plan import dp_sgd_budgets
    from pipeline.privacy import dpsgd

    tree = tiny_pipeline_dict(tmp_path)
    tree["distill"]["method"] = method
    if method == "distil":
        tree["distill"]["candidates"] = [{"alpha": 0.4}, {"alpha": 1.0}]
    tree["privacy"] = {"max_epsilon": 100.0}  # every DP stage checks the run's plan before it computes
    cfg = config_from_dict(tree)
    plans, calibrations, candidates = [], [], []
    _counting(monkeypatch, plan_module, "make_plan", plans)
    _counting(monkeypatch, dpsgd, "calibrate_noise", calibrations)
    _counting(monkeypatch, DistillConfig, "candidate_configs", candidates)
    run = Path(dp_distill(cfg))
    during_run = len(calibrations)
    plan, ledger = plans[0], read_ledger(run / "ledger.json")
    shares = dp_sgd_budgets(cfg, plan.n, plan.unit)
    per_plan = len(calibrations) - during_run + len(shares)  # DPKD's search for its shares, then each stage's σ
    assert len(plans) == 1 and during_run == per_plan  # before: 3 plans, 4 (distil) or 8 (dpkd) calibrations
    assert len(candidates) == (1 if method == "distil" else 0)  # before: 6 calls (2 builds, each validating twice)
    for stage, epsilon in shares.items():
        handed, entry = plan.dp_sgd[stage], ledger.entry(stage)
        assert handed == dpsgd.plan_dp_sgd(cfg.teacher, plan.n, plan.unit, epsilon)  # the stage's own calibration
        assert (entry.noise_multiplier, entry.sample_rate, entry.steps, entry.delta) == (
            handed.sigma, handed.sample_rate, handed.steps_allowed, handed.delta)
        assert entry.epsilon <= epsilon and f"target ε={epsilon}" in entry.note


def test_dpdistill_run_plans_once_and_splits_the_data_once(prefect_server, tmp_path, monkeypatch, capsys):
    """Issue 61: `dpdistill run` makes the run's plan once and splits the private data once, in
    a private directory that the data stage moves into the run; the flow makes neither again,
    and the distillation's candidates are built once, when the config is validated. A rerun
    whose cached splits were deleted after evaluation splits once, the same way; one whose data
    stage is cached splits nothing (the plan reads the cached split). No split is left behind."""
    import yaml
    from conftest import tiny_pipeline_dict
    from pipeline import plan as plan_module
    from pipeline.config import DistillConfig
    from pipeline.stages import data as data_module

    tree = tiny_pipeline_dict(tmp_path)
    tree["distill"]["candidates"] = [{"alpha": 0.4}, {"alpha": 1.0}]
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tree))
    plans, splits, builds = [], [], []
    _counting(monkeypatch, plan_module, "make_plan", plans)
    _counting(monkeypatch, data_module, "prepare_data", splits)
    _counting(monkeypatch, DistillConfig, "_build_candidates", builds)
    cache = Path(tree["run_root"]) / ".cache"

    def run(*overrides: str) -> tuple[Path, tuple[int, int, int]]:
        plans.clear(), splits.clear(), builds.clear()
        assert main(["run", "--config", str(config), *overrides]) == 0
        run_dir = Path(capsys.readouterr().out.strip().splitlines()[-1].removeprefix("run directory: "))
        assert not list(cache.glob("*split-ahead*"))
        return run_dir, (len(plans), len(splits), len(builds))

    first, counts = run()
    assert counts == (1, 1, 1)  # before: 2 plans, 3 splits, 2 builds (the config's and the stage's)
    stages = json.loads((first / "stages.json").read_text())
    assert stages["data"]["status"] == "ran" and "split made for the run's plan, moved here" in (first / "run.log").read_text()
    assert splits[0].train.parent != first / "data"  # made ahead, in the run root's cache, then moved
    # The first run deleted its splits after evaluation: the second writes them again, once.
    second, counts = run("data.keep_private_copies=true")
    assert counts == (1, 1, 1) and json.loads((second / "stages.json").read_text())["data"]["status"] == "ran"
    third, counts = run("data.keep_private_copies=true")  # the second's splits, kept: cached
    assert counts == (1, 0, 1) and json.loads((third / "stages.json").read_text())["data"]["status"] == "cached"
    assert read_ledger(third / "ledger.json") == read_ledger(first / "ledger.json")


def test_markdown_table_keeps_every_cell_text_in_its_cell():
    """The key pages of the UI show a table artifact's description only (flows/artifacts.py),
    so it repeats the table: a generated text with Markdown or HTML in it stays literal text
    in its own cell."""
    from flows.artifacts import markdown_table

    rows = [{"control_code": "Bars | Stars: 5.0", "text": "a|b <script>x</script> *em*\nline [l](u)", "n": 3}]
    md = markdown_table(rows, ["control_code", "text", "n"]).splitlines()
    assert md[:2] == [r"| control\_code | text | n |", "|---|---|---|"] and len(md) == 3
    assert md[2] == r"| Bars \| Stars: 5.0 | a\|b \<script\>x\</script\> \*em\* line \[l\](u) | 3 |"


def test_a_dp_tokenizer_run_learns_its_vocabulary_after_the_data_and_accounts_it(prefect_server, tmp_path):
    """base_models.tokenizer=dp (issue 38 item 5): the pair is built after the data stage, in
    the run directory, with a vocabulary that is a DP release of the training split's words;
    the ledger, the plan and the records' budget carry it, with its threshold's δ in the total;
    the teacher and student speak that vocabulary; the same config again spends nothing new."""
    from conftest import tiny_pipeline_dict
    from pipeline.config import config_from_dict
    from pipeline.plan import make_plan
    from pipeline.privacy.budget import read_budget

    tree = tiny_pipeline_dict(tmp_path)
    tree["base_models"] |= {"tokenizer": "dp", "tokenizer_epsilon": 8.0, "tokenizer_max_words": 8}
    cfg = config_from_dict(tree)
    plan = make_plan(cfg)
    run = Path(dp_distill(cfg))
    stages = json.loads((run / "stages.json").read_text())
    assert list(stages)[:2] == ["data", "base-models"]
    typed = read_ledger(run / "ledger.json")
    assert [e.stage for e in typed.entries][:3] == ["base-models", "control-codes", "teacher"]
    vocab, teacher = typed.entry("base-models"), typed.entry("teacher")
    assert vocab.epsilon == pytest.approx(plan.entries[0].epsilon) and vocab.delta_threshold == teacher.delta
    assert typed.total.delta == pytest.approx(2 * teacher.delta) and typed.total.accountant_delta() == teacher.delta
    made = (run / "base_models" / "tokenizer" / "tokenizer.json").read_text()
    for model in ("teacher/model", "student/model", "base_models/teacher"):
        assert (run / model / "tokenizer.json").read_text() == made, model
    budget_id = json.loads((run / "run.json").read_text())["records_id"]
    assert [r.stage for r in read_budget(Path(cfg.run_root).resolve(), budget_id).releases] == [
        "base-models", "control-codes", "teacher"]

    again = Path(dp_distill(cfg))
    assert json.loads((again / "stages.json").read_text())["base-models"]["status"] == "cached"
    assert len(read_budget(Path(cfg.run_root).resolve(), budget_id).releases) == 3


def test_a_prompt_template_prefixes_every_record_and_no_loss_counts_it(prefect_server, tmp_path, monkeypatch):
    """Issue 59 item 1: with data.prompt_template the codes reach the teacher as a prompt, the same
    in DP training, generation and evaluation; the teacher's and the distillation's losses leave
    the prompt's tokens out (lm_batch is handed each record's prompt length)."""
    from conftest import tiny_pipeline_dict
    from pipeline import batching
    from pipeline.config import config_from_dict
    from pipeline.models.base import load_tokenizer
    from pipeline.prompts import PromptFormat
    from pipeline.stages import distill
    from pipeline.stages.teacher import recipe

    tree = tiny_pipeline_dict(tmp_path)
    tree["data"] |= {"code_template": "{value}", "prompt_template": "A review ({label2}) of a place in {label1}:",
                     "keep_private_copies": True}
    cfg = config_from_dict(tree)
    handed = {"teacher": [], "distillation": []}
    for module, stage in ((recipe, "teacher"), (distill, "distillation")):
        def spy(ids, lengths, prompts=None, stage=stage):
            handed[stage].append(prompts is not None)
            return batching.lm_batch(ids, lengths, prompts)
        monkeypatch.setattr(module, "lm_batch", spy)
    run = Path(dp_distill(cfg))
    assert handed["teacher"] and all(handed["teacher"]) and handed["distillation"] and all(handed["distillation"])
    fmt = PromptFormat.of(cfg.data)
    tok = load_tokenizer(str(run / "teacher" / "model"))
    shard = pq.read_table(run / "synthetic" / "shard-00000.parquet")
    for code, n, ids in zip(*(shard[c].to_pylist() for c in ("control_code", "n_prompt_tokens", "token_ids"))):
        assert ids[:n] == fmt.ids(tok, code) and tok.decode(ids[:n]).startswith("A review (")
    metrics = json.loads((run / "metrics.json").read_text())
    student = metrics["perplexity"]["student_distil"]
    assert student["text_only"]["tokens"] < student["tokens"]  # the prompts' tokens are left out of the text's
