"""experiments/public_proxy.py: the grid grows until the proxy's best learning rate is interior;
the chosen and the config's own run privately; the issue's table lines (issue 60 item 3)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("public_proxy", ROOT / "experiments" / "public_proxy.py")
proxy = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = proxy  # its dataclass looks its module up
spec.loader.exec_module(proxy)


def _run(phase, method, multiple, student, repeat=1, dp_teacher=50.0):
    return {"phase": phase, "method": method, "multiple": multiple, "repeat": repeat, "student": student,
            "student_text_windowed": student * 2, "dp_teacher": dp_teacher}


def test_the_grid_grows_past_an_edge_until_the_best_is_interior():
    results = []
    curve = {0.5: 300, 1.0: 250, 2.0: 220, 4.0: 200, 8.0: 190, 16.0: 195}  # best at 8: past the first grid
    while (todo := proxy._todo(results, "dpsgd", 3))[0] == "proxy":
        results.append(_run("proxy", "dpsgd", todo[1], curve[todo[1]]))
    assert [r["multiple"] for r in results] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
    assert proxy.chosen(results, "dpsgd") == 8.0
    assert todo == ("private", 8.0, 1)  # then the chosen, three runs, then the config's own


def test_the_whole_first_grid_runs_before_a_choice_even_when_an_inner_best_shows_early():
    """The plan names its candidates (0.5, 1, 2, 4): an interior best after three of them is not yet
    the choice; the builtin Yelp pair had stopped at 0.5, 1, 2 before this was fixed."""
    results = [_run("proxy", "dpsgd", m, p) for m, p in ((0.5, 120.7), (1.0, 102.4), (2.0, 106.1))]
    assert proxy.chosen(results, "dpsgd") is None
    assert proxy._todo(results, "dpsgd", 3) == ("proxy", 4.0, 1)
    results.append(_run("proxy", "dpsgd", 4.0, 99.0))  # the fourth wins at the edge: the grid grows
    assert proxy._todo(results, "dpsgd", 3) == ("proxy", 8.0, 1)


def test_a_best_at_the_grids_limit_is_kept_when_it_may_grow_no_more():
    results = [_run("proxy", "ours", m, 100 / m) for m in (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)]
    assert proxy.next_multiple({r["multiple"]: r["student"] for r in results}, 32.0, "ours") is None  # 4 × 2³
    assert proxy.chosen(results, "ours") == 32.0


def test_the_report_ends_with_the_deployable_public_and_the_defaults_lines():
    results = [_run("proxy", m, x, p) for m in proxy.METHODS for x, p in ((0.5, 300), (1.0, 200), (2.0, 210),
                                                                          (4.0, 260))]
    results += [_run("private", m, 1.0, base + k, k) for m, base in (("ours", 150), ("dpsgd", 170), ("dpkd", 180))
                for k in (1, 2, 3)]
    lines = proxy.report(results, "reference").strip().splitlines()
    assert lines[-2] == "table=deployable-public corpus=reference ours=152.0±1.0 dpsgd=172.0±1.0 dpkd=182.0±1.0"
    assert lines[-1] == "table=defaults corpus=reference ours=152.0±1.0 dpsgd=172.0±1.0 dpkd=182.0±1.0"
    assert "| dpsgd | 0.5 → 300.0, 1 → 200.0, 2 → 210.0, 4 → 260.0 | 1 |" in lines[2 + 1]


def test_the_teacher_is_chosen_by_the_dp_teachers_figure_and_shares_ours_runs_at_the_configs_own():
    # ours' proxy run at multiple 1 is the config as it is: the teacher's grid counts it
    results = [_run("proxy", "ours", 1.0, 200, dp_teacher=60.0)]
    assert proxy._todo(results, "teacher", 3) == ("proxy", 0.5, 1)
    results += [_run("proxy", "teacher", m, s, dp_teacher=d) for m, s, d in ((0.5, 150, 70.0), (2.0, 260, 45.0),
                                                                            (4.0, 280, 50.0))]
    assert proxy.chosen(results, "teacher") == 2.0  # the lowest DP teacher, not the lowest student (0.5)
    assert proxy.chosen(results, "ours") is None  # ours' own grid is its distillation's learning rate
    results += [_run("private", "teacher", 2.0, 190 + k, k, dp_teacher=40.0 + k) for k in (1, 2, 3)]
    results += [_run("private", "ours", 1.0, 200 + k, k, dp_teacher=50.0) for k in (1, 2)]
    assert proxy._todo(results, "teacher", 3) == ("private", 1.0, 3)  # ours' two default runs count
    results.append(_run("private", "teacher", 1.0, 203, 3))
    assert proxy._todo(results, "teacher", 3) is None
    assert [r["repeat"] for r in proxy.runs_of(results, "ours", "private", 1.0)] == [1, 2, 3]
    assert proxy.runs_of(results, "dpsgd", "private", 1.0) == []  # another distill.method: another config
    lines = proxy.report(results, "smollm2-yelp").strip().splitlines()
    assert lines[-4] == ("teacher corpus=smollm2-yelp settings=chosen multiple=2 runs=3 dp_teacher=42.0±1.0 "
                         "student=192.0±1.0 text=384.0±2.0 mauve=–")
    assert lines[-3].startswith("teacher corpus=smollm2-yelp settings=default multiple=1 runs=3 dp_teacher=50.0±0.0")


def test_the_proxy_trains_the_private_configs_models_on_its_schedule():
    """SmolLM2 Yelp's proxy is the tweets config, which ships an 8-layer student distilled for 4
    epochs: the learning rate is chosen, on the tweets, for the 4-layer student and the 1 epoch
    Yelp trains; the proxy keeps its own data, lengths and prompt. The builtin pair is unchanged."""
    from pipeline.config import load_config

    yelp = load_config(ROOT / "configs/smollm2_yelp.yaml")
    shipped = load_config(ROOT / "configs/smollm2_airline.yaml")
    tweets = load_config(ROOT / "configs/smollm2_airline.yaml", proxy.same_training(yelp))
    assert (shipped.distill.student_model, shipped.distill.epochs) != (yelp.distill.student_model, yelp.distill.epochs)
    assert (tweets.distill.student_model, tweets.distill.epochs) == (yelp.distill.student_model, yelp.distill.epochs)
    for field in ("model", "epochs", "batch_size"):
        assert getattr(tweets.teacher, field) == getattr(yelp.teacher, field)
    assert tweets.teacher.max_length == shipped.teacher.max_length
    assert (tweets.data, tweets.generate) == (shipped.data, shipped.generate)
    builtin = load_config(ROOT / "configs/airline.yaml")
    assert load_config(ROOT / "configs/airline.yaml", proxy.same_training(load_config(ROOT / "configs/reference.yaml"))) == builtin


def test_a_pinned_study_keeps_the_settings_its_recorded_runs_had():
    """Where a config ships a study's choice since (SmolLM2 Yelp: ours' 2 ×), the study's runs keep
    the value its multiples are relative to: the pin is the base of every tracked candidate, and
    the rows of experiments/utility.py keep it too."""
    import json

    from pipeline.config import load_config

    utility_spec = importlib.util.spec_from_file_location("utility", ROOT / "experiments" / "utility.py")
    utility = importlib.util.module_from_spec(utility_spec)
    utility_spec.loader.exec_module(utility)
    lines = [json.loads(x) for x in (ROOT / "docs/results/public_proxy.jsonl").read_text().splitlines() if x.strip()]
    for name, pins in proxy.PINNED.items():
        assert list(utility.PINNED[name]) == list(pins)
        field, value = pins[0].split("=")
        # the base every recorded candidate of the field's method is a multiple of
        method = next(m for m, study in proxy.METHODS.items() if study.field == field)
        ran = {round(r["learning_rate"] / r["multiple"], 12) for r in lines
               if r["config"] == name and r["method"] == method}
        assert ran == {float(value)}, (name, ran)
        config = proxy.config_path(name)
        assert proxy._value(load_config(config, list(pins)), field) == float(value)
        for row in ("ours", "ours-words", "public-only-words"):
            assert proxy._value(load_config(config, utility.overrides(row, name, 1)), field) == float(value)


def test_a_private_repeat_draws_all_of_its_methods_noise_afresh():
    """DPKD's repeat reruns its DP teacher, not only its student (before 2026-11-30 its three
    private runs shared one teacher); the teacher's rate study reruns the code release too."""
    assert {m: proxy.noisy_stage(m) for m in proxy.METHODS} == {
        "ours": "control-codes", "dpsgd": "dp-student", "dpkd": "teacher", "teacher": "control-codes",
        "teacher-lora": "control-codes", "teacher-epochs": "control-codes"}


def test_the_lora_teacher_runs_with_adapters_and_shares_no_run_with_the_full_teacher():
    """teacher-lora is the teacher's rate study with LoRA adapters (issue 59 item 3): every run of
    it has teacher.mode=lora, so ours' runs at the config's own rate (the full model) are not its
    1 ×, and the report shows it only once it has run on the corpus."""
    from pipeline.config import load_config

    cfg = load_config(ROOT / "configs/smollm2_yelp.yaml", proxy.run_overrides("teacher-lora", 2.0, 5e-4, []))
    assert (cfg.teacher.mode, cfg.teacher.learning_rate) == ("lora", 0.001)
    assert proxy.METHODS["teacher"].fixed == ()
    ours = [_run("proxy", "ours", 1.0, 200, dp_teacher=60.0), _run("private", "ours", 1.0, 210, 1)]
    assert proxy.runs_of(ours, "teacher", "proxy", 1.0) == ours[:1]
    assert proxy.runs_of(ours, "teacher-lora", "proxy", 1.0) == []
    assert proxy._todo(ours, "teacher-lora", 3) == ("proxy", 0.5, 1)
    assert "| teacher" not in proxy.report(ours, "smollm2-yelp")  # no study of the teacher has run yet
    lora = [_run("proxy", "teacher-lora", m, 200, dp_teacher=d) for m, d in ((0.5, 70.0), (1.0, 60.0), (2.0, 50.0),
                                                                            (4.0, 55.0))]
    text = proxy.report(ours + lora, "smollm2-yelp")
    assert "| teacher-lora | 0.5 → 70.0, 1 → 60.0, 2 → 50.0, 4 → 55.0 | 2 |" in text
    assert "teacher-lora corpus=smollm2-yelp settings=chosen multiple=2 runs=0" in text


def test_the_report_says_when_private_repeats_share_a_dp_teacher():
    """DPKD's private runs before 2026-11-30 reran its student alone and read one DP teacher: the
    report says so under the table, once for a choice that is the config's own; runs that each
    trained their own teacher get no note."""
    results = [_run("proxy", "dpkd", m, p) for m, p in ((0.5, 300), (1.0, 200), (2.0, 210), (4.0, 260))]
    shared = [_run("private", "dpkd", 1.0, 180 + k, k, dp_teacher=137.8) for k in (1, 2, 3)]
    text = proxy.report(results + shared, "reference")
    assert text.count("teacher(s)") == 1
    assert "dpkd, private at the config's rate: 3 runs read 1 DP teacher(s) (137.8)" in text
    fresh = [_run("private", "dpkd", 1.0, 180 + k, k, dp_teacher=137.0 + k) for k in (1, 2, 3)]
    assert "teacher(s)" not in proxy.report(results + fresh, "reference")


def test_the_candidate_is_set_last_so_no_pin_or_proxy_schedule_sets_it_back():
    """ours' private runs on SmolLM2 Yelp carry the pin distill.learning_rate=3e-4; a chosen 2 ×
    must still run at 6e-4 (before 2026-12-01 the pin came after the candidate and would have won;
    no recorded run was affected: ours' chosen runs there predate the pin). The proxy's schedule
    sets the teacher's epochs to the private config's: an epochs candidate must still win."""
    from pipeline.config import load_config

    yelp = ROOT / "configs/smollm2_yelp.yaml"
    pins = list(proxy.PINNED["smollm2-yelp"])
    cfg = load_config(yelp, proxy.run_overrides("ours", 2.0, 3e-4, pins))
    assert cfg.distill.learning_rate == 6e-4
    same = proxy.same_training(load_config(yelp))
    tweets = load_config(ROOT / "configs/smollm2_airline.yaml", proxy.run_overrides("teacher-epochs", 4.0, 1, same))
    assert (tweets.teacher.epochs, tweets.teacher.learning_rate, tweets.teacher.mode) == (4, 5e-4, "full")


def test_the_epochs_grid_starts_at_the_configs_one_and_never_goes_below_it():
    """teacher-epochs (P31-P33): whole epochs 1, 2, 4 of the config's 1, the DP teacher's figure;
    its 1 is the config as it is, shared with ours' and the teacher's runs; a best at 1 is kept
    (no half epoch), a best at 4 grows to 8."""
    results = [_run("proxy", "teacher", 1.0, 200, dp_teacher=46.5)]
    assert proxy._todo(results, "teacher-epochs", 3) == ("proxy", 2.0, 1)
    results += [_run("proxy", "teacher-epochs", m, 210, dp_teacher=d) for m, d in ((2.0, 48.0), (4.0, 50.0))]
    assert proxy.chosen(results, "teacher-epochs") == 1.0
    assert proxy._todo(results, "teacher-epochs", 3) == ("private", 1.0, 1)
    falling = results[:1] + [_run("proxy", "teacher-epochs", m, 210, dp_teacher=d) for m, d in ((2.0, 44.0),
                                                                                               (4.0, 42.0))]
    assert proxy._todo(falling, "teacher-epochs", 3) == ("proxy", 8.0, 1)


def test_proxy_only_stops_each_method_at_its_private_runs(tmp_path, monkeypatch):
    """--proxy-only: a method whose proxy has chosen runs nothing more; one still choosing runs its
    next candidate (here recorded without training: run_one is replaced)."""
    import json

    lines = [{"config": "smollm2-yelp", **_run("proxy", "teacher-lora", m, 200, dp_teacher=d)}
             for m, d in ((0.5, 70.0), (1.0, 60.0), (2.0, 50.0), (4.0, 55.0))]
    lines.append({"config": "smollm2-yelp", **_run("proxy", "teacher", 1.0, 200, dp_teacher=46.5)})
    results = tmp_path / "proxy.jsonl"
    results.write_text("".join(json.dumps(x) + "\n" for x in lines))
    ran = []
    monkeypatch.setattr(proxy, "require_data", lambda *a: None)
    monkeypatch.setattr(proxy, "run_one", lambda config, method, multiple, *a: ran.append((method, multiple)) or {
        **_run("proxy", method, multiple, 210, dp_teacher=45.0 - multiple), "seconds": 1.0})
    argv = ["--config", str(ROOT / "configs/smollm2_yelp.yaml"), "--proxy", str(ROOT / "configs/smollm2_airline.yaml"),
            "--methods", "teacher-lora,teacher-epochs", "--proxy-only", "--results", str(results),
            f"run_root={tmp_path}"]
    assert proxy.main(argv) == 0
    assert ran == [("teacher-epochs", 2.0), ("teacher-epochs", 4.0), ("teacher-epochs", 8.0),
                   ("teacher-epochs", 16.0), ("teacher-epochs", 32.0)]  # falling to the grid's limit, 4 × 2³
    assert proxy.chosen(proxy.read_results(results, "smollm2-yelp"), "teacher-epochs") == 32.0


def test_the_utility_studys_runs_of_the_same_config_fill_the_private_runs_at_the_configs_own(tmp_path):
    """Issue 60: runs shared with the utility issue count for both. The tweets config ships what
    `ours-8l` ran (8 layers, four epochs, the prompt): its three runs, each on its own DP teacher,
    are ours' private runs at 1 × there; DP-SGD's utility row pins the header, another config. On
    Yelp, whose harness ran its own three, `ours-words` (the same config) adds none."""
    import json

    utility = ROOT / "docs/results/utility.jsonl"
    tweets, yelp = str(ROOT / "configs/smollm2_airline.yaml"), str(ROOT / "configs/smollm2_yelp.yaml")
    shared = proxy.utility_runs(utility, tweets, "ours", 3e-4, [])
    assert [(r["row"], r["repeat"]) for r in shared] == [("ours-8l", 3), ("ours-8l", 4), ("ours-8l", 5)]
    assert proxy.utility_runs(utility, tweets, "dpsgd", 5e-4, []) == []
    filled = proxy.with_shared([], shared, "ours")
    assert [r["repeat"] for r in proxy.runs_of(filled, "ours", "private", 1.0)] == [1, 2, 3]
    assert proxy._todo(filled + [_run("proxy", "ours", m, 100 + m) for m in (0.5, 1.0, 2.0, 4.0)], "ours", 3) \
        == ("proxy", 0.25, 1)  # the grid still grows; then only the chosen's private runs remain
    assert ("ours, private at the config's rate: 3 run(s) of experiments/utility.py, the same config (row ours-8l, "
            "repeats 3, 4, 5)") in proxy.report(filled, "smollm2-airline")
    pins = list(proxy.PINNED["smollm2-yelp"])
    words = proxy.utility_runs(utility, yelp, "ours", 3e-4, pins)
    assert {r["row"] for r in words} == {"ours-words"}
    own = [_run("private", "ours", 1.0, 210 + k, k) for k in (1, 2, 3)]
    assert proxy.with_shared(own, words, "ours") == own
    lines = [json.loads(x) for x in utility.read_text().splitlines() if '"ours-8l"' in x]
    lines[0]["paired"] = False  # its run found another's DP teacher: not a draw of its own
    copy = tmp_path / "utility.jsonl"
    copy.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert [r["repeat"] for r in proxy.utility_runs(copy, tweets, "ours", 3e-4, [])] == [4, 5]


def test_a_run_whose_config_has_changed_since_is_kept_out_and_runs_again(tmp_path, monkeypatch):
    """Issue 60: a row counts only the runs of the config it names today. A recorded run whose
    digest is not the one its method, phase and multiple resolve to now (here the stars' raw
    values, as configs/smollm2_yelp.yaml shipped them until 2026-11-30) is kept out of the table,
    named, and runs again; a run with today's digest counts, and so does a line recorded before
    digests were (it cannot be checked)."""
    import json

    from experiments.utility import RAW_STARS
    from pipeline.config import load_config

    yelp = str(ROOT / "configs/smollm2_yelp.yaml")
    extra = [*proxy.PINNED["smollm2-yelp"], f"run_root={tmp_path}"]
    base = proxy._value(load_config(yelp), "teacher.learning_rate")

    def digest(*more):
        return proxy.config_digest(load_config(yelp, proxy.run_overrides("dpsgd", 2.0, base, [*more, *extra])))

    assert digest() == digest("run_root=elsewhere", "threads=2") != digest(*RAW_STARS)
    lines = [_run("proxy", "dpsgd", m, p) for m, p in ((0.5, 580.0), (1.0, 460.0), (2.0, 420.0), (4.0, 430.0))]
    lines += [{**_run("private", "dpsgd", 2.0, 390.0, 1), "config_digest": digest()},
              {**_run("private", "dpsgd", 2.0, 300.0, 2), "config_digest": digest(*RAW_STARS)},
              _run("private", "dpsgd", 2.0, 392.0, 3)]
    results = tmp_path / "proxy.jsonl"
    results.write_text("".join(json.dumps({"config": "smollm2-yelp", **x}) + "\n" for x in lines))
    argv = ["--config", yelp, "--proxy", str(ROOT / "configs/smollm2_airline.yaml"), "--results", str(results),
            f"run_root={tmp_path}"]
    assert proxy.main([*argv, "--report-only"]) == 0
    text = (tmp_path / "smollm2-yelp-public-proxy.md").read_text()
    assert "table=deployable-public corpus=smollm2-yelp ours=– dpsgd=391.0±1.4 dpkd=–" in text
    assert text.endswith("kept out, their config changed since they ran (they run again): 1 run(s): "
                         "dpsgd private m=2 r2\n")
    ran = []
    monkeypatch.setattr(proxy, "require_data", lambda *a: None)
    monkeypatch.setattr(proxy, "run_one", lambda config, method, multiple, base, phase, repeat, *a: ran.append(
        (multiple, repeat)) or {**_run(phase, method, multiple, 395.0, repeat), "seconds": 1.0})
    assert proxy.main([*argv, "--methods", "dpsgd"]) == 0
    assert ran == [(2.0, 2), (1.0, 1), (1.0, 2), (1.0, 3)]
