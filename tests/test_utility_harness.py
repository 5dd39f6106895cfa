"""experiments/utility.py: its rows' overrides and the issue's last lines (issue 59)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("utility", ROOT / "experiments" / "utility.py")
utility = importlib.util.module_from_spec(spec)
spec.loader.exec_module(utility)
CONFIGS = {"smollm2-airline": "configs/smollm2_airline.yaml", "smollm2-yelp": "configs/smollm2_yelp.yaml"}


def _run(row, k, student, text, **extra):
    return {"row": row, "repeat": k, "student": student, "student_text_windowed": text, "epsilon": 1.98,
            "dp_teacher": 60.0 + k, "dp_teacher_text": 70.0 + k, "base_teacher": 79.1, "base_teacher_text": 69.9,
            "mauve": 0.4 + k / 100, **extra}


def test_the_report_ends_with_the_issues_lines():
    ds = {"sentiment": {"macro_f1": 0.40, "chance_macro_f1": 0.333, "real_reference_macro_f1": 0.555}}
    results = [_run("ours", k, 150.0 + k, 200.0 + k, downstream=ds) for k in (1, 2, 3)]
    results += [_run("public-only", k, 180.0 + k, 240.0, dp_teacher=None) for k in (1, 2, 3)]
    results += [_run("dp-sgd", k, 200.0 + 2 * k, 260.0, dp_teacher=None) for k in (1, 2, 3)]
    lines = utility.report(results, "smollm2-airline", "smollm2-135m").strip().splitlines()
    assert lines[-3] == ("synthetic model=smollm2-135m corpus=smollm2-airline column=sentiment runs=3 "
                         "f1=0.400±0.000 chance=0.333 reference=0.555 mauve=0.420±0.010")
    assert lines[-2] == ("student model=smollm2-135m corpus=smollm2-airline runs=3 ours=152.0±1.0 "
                         "public_only=182.0±1.0 dpsgd=204.0±2.0 teacher=62.0±1.0 base_teacher=79.1")
    assert lines[-1].startswith("student model=smollm2-135m corpus=smollm2-airline figure=text_alone runs=3 "
                                "ours=202.0±1.0")


def test_each_prompted_row_takes_its_corpus_prompt_and_the_control_varies_its_seed():
    assert utility.overrides("ours-header", "smollm2-airline", 2) == ["distill.method=distil",
                                                                       *utility.HEADERS["smollm2-airline"],
                                                                       utility.FOUR, "distill.epochs=1"]
    ours = utility.overrides("ours", "smollm2-airline", 1)
    assert ours[0] == "distill.method=distil" and ours[1:-2] == list(utility.PROMPTS["smollm2-airline"])
    assert utility.overrides("public-only", "smollm2-yelp", 3)[-1] == "seed=2"


def test_the_tweets_config_ships_what_won_and_every_row_keeps_what_it_ran_with():
    """The tweets config ships 4 epochs (ours-long) and the 8-layer student (ours-8l); a row's later
    run must match its first, so each row pins the student and epochs it ran with."""
    shipped = load_config(ROOT / "configs/smollm2_airline.yaml")
    assert (shipped.distill.epochs, shipped.distill.student_model) == (4, "cache:smollm2-135m-8l")
    ran_with = {"ours-8l": "cache:smollm2-135m-8l", "ours-8l-gpu": "cache:smollm2-135m-8l-gpu",
                **{r: "cache:smollm2-135m-12l-gpu" for r in ("ours-12l-gpu", "public-only-12l-gpu", "dp-sgd-12l-gpu")}}
    for name, config in CONFIGS.items():
        for row in (r for r in utility.ROWS if not utility.lacks(r, name)):
            cfg = load_config(ROOT / config, utility.overrides(row, name, 1))
            assert cfg.distill.student_model == ran_with.get(row, "cache:smollm2-135m-4l"), (name, row)
            if not row.startswith("dp-sgd"):  # DP-SGD of the student trains by the teacher section's epochs
                assert cfg.distill.epochs == (4 if row in ("ours-long", "ours-8l", "ours-8l-gpu", "ours-12l-gpu", "public-only-12l-gpu") else 1), (name, row)


def test_the_header_rows_get_the_room_the_corpus_is_scored_in():
    """A header row (ours-header, dp-sgd) trains and writes in as many positions as the corpus's
    test windows hold (the tweets 64, Yelp 96), the room its config gave the header form; the
    prompted rows get the prompt's tokens on top. Yelp's header rows once took the tweets' 64."""
    for name, config in CONFIGS.items():
        for row in ("ours-header", "dp-sgd"):
            cfg = load_config(ROOT / config, utility.overrides(row, name, 1))
            assert cfg.data.prompt_template is None, (name, row)
            assert cfg.teacher.max_length == cfg.generate.max_length == cfg.evaluate.window, (name, row)
        prompted = load_config(ROOT / config, utility.overrides("ours", name, 1))
        assert prompted.teacher.max_length > cfg.teacher.max_length, name


def test_both_smollm2_configs_ship_the_prompt_that_won():
    """The prompt won on both corpora (docs/utility.md: the student's text alone and MAUVE, and
    on the tweets the sentiment classifier), and on Yelp the stars named in words (P20): each config
    is the row that won, the tweets' `ours`, Yelp's `ours-words`."""
    for name, config in CONFIGS.items():
        shipped = load_config(ROOT / config)
        prompted = load_config(ROOT / config, list(utility.WORDS[name]))
        assert shipped.control_codes == prompted.control_codes, name
        assert (shipped.data, shipped.teacher, shipped.generate) == (prompted.data, prompted.teacher,
                                                                     prompted.generate), name


def test_every_prompt_is_a_valid_override_of_its_config():
    for name, config in CONFIGS.items():
        cfg = load_config(ROOT / config, list(utility.PROMPTS[name]))
        assert cfg.name == name and cfg.data.prompt_template and cfg.data.system_prompt == ""


def test_the_privacy_utility_figure_is_drawn_from_the_results(tmp_path):
    """Issue 59 item 6: one point per row and target ε (mean ± sd over runs), x the ledger's ε."""
    spec = importlib.util.spec_from_file_location("privacy_utility", ROOT / "experiments" / "privacy_utility.py")
    figure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figure)
    results = [_run("ours", k, 150.0 + k, 200.0 + k) for k in (1, 2)]
    results += [{**_run("ours", k, 120.0 + k, 170.0, epsilon=7.9), "target_epsilon": 8.0} for k in (1, 2)]
    results += [{**_run("dp-sgd", 1, 300.0, 400.0, epsilon=0.5), "target_epsilon": 0.5}]
    results += [_run("public-only", 1, 180.0, 240.0, epsilon=0.0)]
    assert figure.series(results, "student", "ours") == [(1.98, 151.5, 0.7071067811865476), (7.9, 121.5,
                                                                                              0.7071067811865476)]
    assert figure.series(results, "student_text_windowed", "dp-sgd") == [(0.5, 400.0, 0.0)]
    points = figure.table(results).splitlines()
    assert points[2] == "| ours | windowed | – | – | 151.5±0.7 (2) | – | 121.5±0.7 (2) |"  # the main rows count as ε 2
    assert points[5] == "| dp-sgd | on the text alone | 400.0±– (1) | – | – | – | – |"
    out = figure.draw(results, tmp_path / "fig.png", "airline")
    assert out.stat().st_size > 10_000


def test_the_kept_row_reuses_ours_teacher_and_reports_its_classifier():
    """Issue 59 item 4: ours-kept keeps ours' run k (no fresh noise, no new seed) and learns from the
    samples the teacher recognises; its lines say how many were kept and whether each run was paired."""
    kept = utility.overrides("ours-kept", "smollm2-airline", 2)
    assert kept[-1] == "distill.keep_samples=code_adherent" and not any(o.startswith("seed=") for o in kept)
    ds = {"sentiment": {"macro_f1": 0.40, "chance_macro_f1": 0.333, "real_reference_macro_f1": 0.555}}
    results = [_run("ours", 1, 150.0, 200.0, downstream=ds)]
    results += [_run("ours-kept", 1, 151.0, 201.0, paired=True,
                     downstream_kept={"sentiment": {"macro_f1": 0.45, "synthetic_train": 900}})]
    text = utility.report(results, "smollm2-airline", "smollm2-135m")
    assert ("synthetic-kept model=smollm2-135m corpus=smollm2-airline column=sentiment runs=1 f1=0.450±– "
            "samples=900±– paired=1") in text


def test_the_header_and_control_rows_get_their_synthetic_text_scored_too():
    """P1 compares ours' classifier with the header's; the ε = 0 control's text is scored beside."""
    ds = {"sentiment": {"macro_f1": 0.38, "chance_macro_f1": 0.333, "real_reference_macro_f1": 0.555}}
    results = [_run("ours", 1, 150.0, 200.0, downstream=ds), _run("ours-header", 1, 190.0, 380.0, downstream=ds)]
    text = utility.report(results, "smollm2-airline", "smollm2-135m")
    assert ("synthetic row=ours-header model=smollm2-135m corpus=smollm2-airline column=sentiment runs=1 "
            "f1=0.380±– chance=0.333 reference=0.555 mauve=0.410±–") in text
    assert "synthetic row=public-only" not in text  # no run of it: no line


def test_the_shipped_tweets_config_is_the_ours_row_and_the_header_rows_keep_the_header():
    """The tweets config ships what won (the prompt; docs/utility.md): `ours` resolves to it exactly,
    so its runs reuse their stages; the header rows still run the header at 64 positions."""
    shipped = load_config(ROOT / "configs/smollm2_airline.yaml")
    assert load_config(ROOT / "configs/smollm2_airline.yaml", list(utility.PROMPTS["smollm2-airline"])) == shipped
    header = load_config(ROOT / "configs/smollm2_airline.yaml", utility.overrides("dp-sgd", "smollm2-airline", 1)[1:])
    assert header.data.prompt_template is None and header.data.system_prompt is None
    assert header.teacher.max_length == header.generate.max_length == 64


def test_a_paired_row_is_reported_run_by_run_against_the_ours_run_it_reused():
    """ours-long (issue 59 item 5) and ours-kept reuse ours' run k: the paired difference is their figure."""
    long = utility.overrides("ours-long", "smollm2-airline", 1)
    assert long[-1] == "distill.epochs=4" and not any(o.startswith("seed=") for o in long)
    results = [_run("ours", k, 150.0 + k, 200.0 + 2 * k, run_dir=f"r{k}") for k in (1, 2)]
    results += [_run("ours-long", k, 120.0 + 3 * k, 190.0, paired_with=f"r{k}", paired=True) for k in (1, 2)]
    results.append(_run("ours-long", 3, 100.0, 150.0, paired_with="r3", paired=False))  # another teacher: left out
    text = utility.report(results, "smollm2-airline", "smollm2-135m")
    assert "paired row=ours-long corpus=smollm2-airline runs=2 student_minus_ours=-27.0±1.4 text_minus_ours=-13.0±1.4" in text


def test_every_rows_overrides_load_on_both_configs_or_name_what_the_corpus_lacks():
    for name, config in CONFIGS.items():
        for row in utility.ROWS:
            if missing := utility.lacks(row, name):
                with pytest.raises(SystemExit, match=f"row {row} has no {missing} for {name}"):
                    utility.overrides(row, name, 2)
                continue
            cfg = load_config(ROOT / config, utility.overrides(row, name, 2))
            assert cfg.name == name
    assert [r for r in utility.ROWS if utility.lacks(r, "smollm2-airline")] == ["public-only-words-2x"]


def test_the_yelp_control_at_ours_proxy_rate_is_the_shipped_config_with_the_one_switch():
    """P34: `public-only-words-2x` is the ε = 0 control at the distillation rate the public proxy
    chose for ours on Yelp: the config as shipped (its rate, the stars named) with
    distill.method=public_only, the seed its repeat's; and that rate is the proxy's choice, so the
    README's row compares ours and its control at one rate."""
    from experiments.public_proxy import chosen  # importable: utility.py put the checkout on the path

    row = load_config(ROOT / CONFIGS["smollm2-yelp"], utility.overrides("public-only-words-2x", "smollm2-yelp", 3))
    shipped = load_config(ROOT / CONFIGS["smollm2-yelp"], ["distill.method=public_only", "seed=2"])
    assert row == shipped
    lines = [json.loads(x) for x in (ROOT / "docs/results/public_proxy.jsonl").read_text().splitlines() if x.strip()]
    pick = chosen([r for r in lines if r["config"] == "smollm2-yelp"], "ours")
    assert row.distill.learning_rate == pick * float(utility.PINNED["smollm2-yelp"][0].split("=")[1])


def test_the_codes_tokens_perplexity_is_recovered_from_the_two_windowed_figures(tmp_path):
    """The windowed figure of a prompted row also scores the prompt, which no loss trains; the
    counts copied from each run's metrics.json give the codes' tokens' own perplexity exactly."""
    import json
    import math

    spec = importlib.util.spec_from_file_location("privacy_utility", ROOT / "experiments" / "privacy_utility.py")
    figure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figure)
    run = tmp_path / "run"
    run.mkdir()
    ppl = {"base_teacher": {"tokens": 99, "text_only": {"tokens": 1}},
           "student_distil": {"windowed": math.exp(2.0), "tokens": 10, "text_only": {"windowed": math.e, "tokens": 6}}}
    (run / "metrics.json").write_text(json.dumps({"perplexity": ppl}))
    results = tmp_path / "utility.jsonl"
    lines = [_run("ours", 1, math.exp(2.0), math.e, run_dir=str(run)), _run("ours", 2, 150.0, 200.0, run_dir="gone")]
    results.write_text("".join(json.dumps(r) + "\n" for r in lines))
    tokens = figure.tokens_path(results)
    assert tokens.name == "utility_tokens.jsonl"
    missing = figure.record_tokens(results, tokens)
    assert len(missing) == 1 and missing[0].startswith("gone: ")  # named, not raised
    assert figure.record_tokens(results, tokens) == missing  # the recorded run is not appended twice
    assert figure.read_results(tokens) == [{"run_dir": str(run), "tokens": 10, "text_tokens": 6}]
    scored = figure.with_codes(lines, figure.read_results(tokens))
    assert math.isclose(scored[0][figure.CODES], math.exp((20.0 - 6.0) / 4))  # 14 nats over the 4 prompt tokens
    assert figure.CODES not in scored[1]
    assert "| ours | the codes' tokens alone | – | – | 33.1±– (1) | – | – |" in figure.table(scored).splitlines()


def test_the_words_row_names_every_star_in_the_prompt_and_the_released_domain():
    """`ours-words` (P20): Yelp's five raw star values each get a distinct name, the released code
    distribution's domain is those names (the DP histogram is over what the prompts say), and the
    prompt carries the name; its synthetic text is scored like ours'."""
    cfg = load_config(ROOT / CONFIGS["smollm2-yelp"], utility.overrides("ours-words", "smollm2-yelp", 1))
    names = cfg.data.code_values["label2"]
    ours = load_config(ROOT / CONFIGS["smollm2-yelp"], utility.overrides("ours", "smollm2-yelp", 1))
    assert sorted(names) == sorted(ours.control_codes.domain["label2"]) and len(set(names.values())) == 5
    assert cfg.control_codes.domain["label2"] == list(names.values())
    assert cfg.control_codes.domain["label1"] == ours.control_codes.domain["label1"]
    from pipeline.prompts import PromptFormat
    prompt = PromptFormat.of(cfg.data)
    code = "Business Category: Bars\t" + names["Review Stars: 1.0"]
    assert prompt.template.format(**prompt.values(code)) == (
        "Write a very negative (1 of 5 stars) Yelp review of a business. Business Category: Bars.")
    ds = {"label2": {"macro_f1": 0.3, "chance_macro_f1": 0.2, "real_reference_macro_f1": 0.35}}
    text = utility.report([_run("ours-words", 1, 200.0, 230.0, downstream=ds)], "smollm2-yelp", "smollm2-135m")
    assert "synthetic row=ours-words model=smollm2-135m corpus=smollm2-yelp column=label2 runs=1 f1=0.300±–" in text


def test_the_yelp_rows_that_ran_with_raw_stars_keep_them():
    """Yelp's config ships the stars named (P20); `ours`, the ε = 0 control and the header rows ran
    with the raw values ("Review Stars: 4.0") and keep them, so a later run of a row matches its first."""
    for row in ("ours", "public-only", "ours-header", "dp-sgd"):
        cfg = load_config(ROOT / CONFIGS["smollm2-yelp"], utility.overrides(row, "smollm2-yelp", 2))
        assert cfg.data.code_values == {} and cfg.control_codes.domain["label2"] == utility.STAR_VALUES, row


def test_the_words_pair_gets_its_own_student_line_once_its_control_ran():
    """P22: `public-only-words` is the ε = 0 control of `ours-words` (the same named-stars prompt,
    the base teacher); its text is scored and the pair gets a `student row=words` line beside the
    issue's, which stays `ours` against `public-only`. No control run: no words line."""
    cfg = load_config(ROOT / CONFIGS["smollm2-yelp"], utility.overrides("public-only-words", "smollm2-yelp", 2))
    words = load_config(ROOT / CONFIGS["smollm2-yelp"], utility.overrides("ours-words", "smollm2-yelp", 1))
    assert cfg.distill.method == "public_only" and cfg.seed == 1
    assert (cfg.data.prompt_template, cfg.data.code_values) == (words.data.prompt_template, words.data.code_values)
    ds = {"label2": {"macro_f1": 0.25, "chance_macro_f1": 0.2, "real_reference_macro_f1": 0.35}}
    results = [_run("ours", 1, 150.0, 200.0), _run("public-only", 1, 180.0, 240.0, dp_teacher=None),
               _run("dp-sgd", 1, 300.0, 400.0, dp_teacher=None), _run("ours-words", 1, 155.0, 205.0)]
    assert "student row=words" not in utility.report(results, "smollm2-yelp", "smollm2-135m")
    results.append(_run("public-only-words", 1, 170.0, 230.0, dp_teacher=None, downstream=ds))
    lines = utility.report(results, "smollm2-yelp", "smollm2-135m").strip().splitlines()
    assert lines[-4].startswith("student model=smollm2-135m corpus=smollm2-yelp runs=1 ours=150.0±–")
    assert lines[-2] == ("student row=words model=smollm2-135m corpus=smollm2-yelp runs=1 ours=155.0±– "
                         "public_only=170.0±– dpsgd=300.0±– teacher=61.0±– base_teacher=79.1")
    assert lines[-1].startswith("student row=words model=smollm2-135m corpus=smollm2-yelp figure=text_alone runs=1 "
                                "ours=205.0±– public_only=230.0±–")
    assert ("synthetic row=public-only-words model=smollm2-135m corpus=smollm2-yelp column=label2 runs=1 "
            "f1=0.250±–") in "\n".join(lines)



def test_the_12_layer_student_gets_its_own_student_line_against_its_own_controls():
    """P26: with the 12-layer student, ours is compared with the ε = 0 control and DP-SGD of that
    same student, not with the 4-layer rows' figures."""
    results = [_run("ours", 1, 150.0, 200.0), _run("public-only", 1, 180.0, 240.0, dp_teacher=None),
               _run("dp-sgd", 1, 300.0, 400.0, dp_teacher=None), _run("ours-12l-gpu", 1, 100.0, 98.0),
               _run("public-only-12l-gpu", 1, 130.0, 140.0, dp_teacher=None)]
    assert "student row=12l" not in utility.report(results[:4], "smollm2-yelp", "smollm2-135m")
    results.append(_run("dp-sgd-12l-gpu", 1, 250.0, 260.0, dp_teacher=None))
    lines = utility.report(results, "smollm2-yelp", "smollm2-135m").strip().splitlines()
    assert lines[-2] == ("student row=12l model=smollm2-135m corpus=smollm2-yelp runs=1 ours=100.0±– "
                         "public_only=130.0±– dpsgd=250.0±– teacher=61.0±– base_teacher=79.1")
    assert lines[-4].startswith("student model=smollm2-135m corpus=smollm2-yelp runs=1 ours=150.0±– "
                                "public_only=180.0±– dpsgd=300.0±–")
    dp = load_config(ROOT / CONFIGS["smollm2-yelp"], utility.overrides("dp-sgd-12l-gpu", "smollm2-yelp", 2))
    assert (dp.distill.method, dp.distill.student_model) == ("dp_sgd", "cache:smollm2-135m-12l-gpu")

def test_a_rows_repeat_reruns_its_methods_first_noisy_stage():
    """Each row that draws its own noise reruns its method's first noisy stage (pipeline/methods.py);
    the ε = 0 rows vary their seed; the paired rows reuse ours' run."""
    from pipeline.methods import method_spec

    for name, config in CONFIGS.items():
        for row, (_, stage) in utility.ROWS.items():
            if stage != utility.PAIRED and not utility.lacks(row, name):
                method = load_config(ROOT / config, utility.overrides(row, name, 1)).distill.method
                assert stage == method_spec(method).noisy_stage, (name, row)


def test_a_paired_run_is_paired_only_when_it_reused_that_runs_teacher(tmp_path):
    """The stage cache serves the latest run with the same settings, which may be another study's:
    the pairing reads where the teacher came from (stages.json), not only its perplexity."""
    ours, other, run = tmp_path / "ours-r1", tmp_path / "private-ours-r3", tmp_path / "ours12l-r1"
    run.mkdir()
    paired_with = {"run_dir": str(ours), "dp_teacher": 43.6}

    def reused(source: Path) -> dict:
        (run / "stages.json").write_text(json.dumps({"teacher": {"status": "cached", "output": str(source / "teacher")}}))
        return utility.pairing(run, 43.6, paired_with)

    assert reused(ours) == {"paired_with": str(ours), "teacher_from": str(ours), "paired": True}
    assert reused(other)["paired"] is False and reused(other)["teacher_from"] == str(other)
    assert utility.pairing(run, 43.7, {"run_dir": str(other), "dp_teacher": 43.6})["paired"] is False


def test_a_run_of_a_config_since_changed_is_kept_out_of_the_report_and_the_readme_and_runs_again(tmp_path, monkeypatch):
    """Issue 60: each line records its config's digest; one whose row resolves to another config
    today is named and kept out, of this report and of the README's table (results_table.py), and
    the row's repeat runs again. `ours-words` resolves to what the public-proxy harness runs at
    the config's own, so the two studies' digests agree where they share runs."""
    import sys

    sys.path.insert(0, str(ROOT))
    from experiments import public_proxy, results_table

    yelp = CONFIGS["smollm2-yelp"]
    digest_of = utility.digests(yelp, [])
    words = digest_of({"row": "ours-words", "repeat": 1})
    assert words == public_proxy.digests(yelp, None, [])({"phase": "private", "method": "ours", "multiple": 1.0})
    assert words != digest_of({"row": "ours", "repeat": 1})  # the raw star values
    assert digest_of({"row": "a-retired-row", "repeat": 1}) is None
    lines = [{"config": "smollm2-yelp", "run_dir": f"r{k}", **_run("ours-words", k, 210.0 + k, 238.0, config_digest=d)}
             for k, d in ((1, words), (2, words), (3, "0" * 16))]  # run 3 ran another config
    lines[2]["student"] = 150.0
    results = tmp_path / "utility.jsonl"
    results.write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = ["--config", yelp, "--rows", "ours-words", "--results", str(results), f"run_root={tmp_path}"]
    assert utility.main([*argv, "--report-only"]) == 0
    text = (tmp_path / "smollm2-yelp-utility.md").read_text()
    assert "| ours-words | 2 | 211.5±0.7 |" in text
    assert text.endswith("kept out, their config changed since they ran (they run again): 1 run(s): ours-words run 3\n")
    monkeypatch.setattr(results_table, "RESULTS", tmp_path)
    assert [r["repeat"] for r in results_table.runs_of_row("utility.jsonl", "smollm2-yelp", "ours-words")] == [1, 2]
    ran = []
    monkeypatch.setattr(utility, "require_data", lambda *a: None)
    monkeypatch.setattr(utility, "record_tokens", lambda *a: None)
    monkeypatch.setattr(utility, "run_one", lambda config, corpus, row, k, *a: ran.append((row, k)) or {
        **_run(row, k, 212.0, 238.0), "run_dir": "new", "seconds": 1.0})
    assert utility.main(argv) == 0
    assert ran == [("ours-words", 3)]


def test_the_privacy_utility_figure_leaves_out_a_run_of_a_config_since_changed(tmp_path, capsys):
    import sys

    sys.path.insert(0, str(ROOT))
    from experiments import privacy_utility

    tweets = CONFIGS["smollm2-airline"]
    digest = utility.digests(tweets, [])({"row": "ours", "repeat": 1, "target_epsilon": 0.5})
    lines = [{"config": "smollm2-airline", "run_dir": f"r{k}", **_run("ours", k, 300.0 + k, 400.0, target_epsilon=0.5,
                                                                      config_digest=d)}
             for k, d in ((1, digest), (2, "0" * 16))]
    results = tmp_path / "utility.jsonl"
    results.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert privacy_utility.main(["--results", str(results), "--report-only"]) == 0
    out, err = capsys.readouterr()
    assert "| ours | windowed | 301.0±– (1) |" in out
    assert "1 run(s): ours run 2 at ε 0.5" in err
