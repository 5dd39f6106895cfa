"""Choosing the student among distillation candidates from DP outputs only (issue 20)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.config import ConfigError, DistillConfig, config_from_dict
from pipeline.models.base import load_causal_lm
from pipeline.models.scoring import nll_by_owner
from pipeline.stages.distill import distill
from pipeline.stages.sampling import sample_untruncated
from pipeline.stages.selection import choose, criterion_study, score_students, spearman
from pipeline.tokenized import ListIds
from conftest import make_tiny_model, tiny_pipeline_dict


def test_untruncated_samples_follow_the_whole_distribution(tiny_model_dir, tiny_tokenizer):
    """No top-k, no top-p: the first generated token lands outside the model's 50 most likely
    tokens as often as its softmax says (HF's generate would apply its default top_k=50 if the
    truncation were merely left unset)."""
    model = load_causal_lm(str(tiny_model_dir)).eval()
    prompt = "Category: A\n\n"
    ids = tiny_tokenizer.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        p = torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)  # (V,)
    top50 = set(torch.topk(p, 50).indices.tolist())
    tail_mass = float(1 - p[list(top50)].sum())
    assert tail_mass > 0.2  # a random tiny model: the tail is large, so truncation would show
    n = 600
    seqs = sample_untruncated(model, tiny_tokenizer, {"Category: A": 1.0}, n, len(ids) + 1, seed=0, batch_size=200)
    first = [s[len(ids)] for s in seqs]
    outside = sum(t not in top50 for t in first) / n
    sd = (tail_mass * (1 - tail_mass) / n) ** 0.5
    assert abs(outside - tail_mass) < 4 * sd, (outside, tail_mass)


def test_a_student_equal_to_the_teacher_scores_zero_kl_and_is_chosen(tiny_model_dir, tiny_tokenizer):
    teacher = load_causal_lm(str(tiny_model_dir))
    torch.manual_seed(1)
    other = make_tiny_model(tiny_tokenizer)
    seqs = sample_untruncated(teacher, tiny_tokenizer, {"Category: A": 1.0}, 12, 24, seed=0)
    scores = score_students(teacher, {"other": other, "copy": load_causal_lm(str(tiny_model_dir))},
                            ListIds(seqs, tiny_tokenizer.pad_token_id), len(tiny_tokenizer), batch_size=5)
    assert scores["copy"]["teacher_kl"] == pytest.approx(0.0, abs=1e-5)
    assert scores["other"]["teacher_kl"] > 0.01
    # The CE equals the KL plus the teacher's entropy only in expectation: on 12 samples its
    # gap can even have the wrong sign, which is why teacher_kl is the default criterion.
    assert all(s["untruncated_ce"] > 0 for s in scores.values())
    rows = [{"candidate": k, **v} for k, v in scores.items()]
    assert choose(rows, "teacher_kl") == "copy"


def test_distill_keeps_the_planted_best_candidate(synthetic, tiny_model_dir, tmp_path):
    """The student starts as a copy of the teacher. Candidate 'learning_rate=1e-09' barely
    moves it (KL ~ 0), the other is driven away by a large learning rate: the first is kept,
    its weights are the stage's model, and the selection table is written."""
    student = tmp_path / "student"
    shutil.copytree(tiny_model_dir, student)
    cfg = DistillConfig(candidates=[{"learning_rate": 0.5, "epochs": 3}, {"learning_rate": 1e-9}], batch_size=8,
                        eval_every=1000, log_every=1000, selection_samples=16)
    result = distill(cfg, synthetic_path=synthetic.path, teacher_dir=tiny_model_dir, student_model=str(student),
                     out_dir=tmp_path / "out", seed=0)
    sel = json.loads((tmp_path / "out" / "selection.json").read_text())
    assert sel["chosen"] == "learning_rate=1e-09" == result.selection["chosen"]
    kl = {r["candidate"]: r["teacher_kl"] for r in sel["candidates"]}
    assert kl["learning_rate=1e-09"] < 1e-3 < kl["epochs=3,learning_rate=0.5"]
    assert {r["candidate"] for r in sel["candidates"]} == {"epochs=3,learning_rate=0.5", "learning_rate=1e-09"}
    assert all(r["untruncated_ce"] > 0 and r["synthetic_validation_ce"] is not None for r in sel["candidates"])
    kept = load_causal_lm(str(result.checkpoint)).state_dict()
    base = load_causal_lm(str(tiny_model_dir)).state_dict()
    assert all(torch.allclose(kept[k], base[k], atol=1e-5) for k in base)
    assert not (tmp_path / "out" / "candidates").exists() and result.candidates is None
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["chosen"] == "learning_rate=1e-09" and "selection" in manifest["outputs"]


def test_keep_candidates_keeps_every_student(synthetic, tiny_model_dir, tmp_path):
    cfg = DistillConfig(candidates=[{"alpha": 0.0}, {"alpha": 1.0}], batch_size=8, epochs=1, eval_every=1000,
                        selection_samples=8, keep_candidates=True, select_by="untruncated_ce")
    result = distill(cfg, synthetic_path=synthetic.path, teacher_dir=tiny_model_dir,
                     student_model=str(tiny_model_dir), out_dir=tmp_path, seed=0)
    assert set(result.candidates) == {"alpha=0.0", "alpha=1.0"}
    assert all((p / "model.safetensors").is_file() for p in result.candidates.values())
    rows = result.selection["candidates"]
    assert result.selection["chosen"] == min(rows, key=lambda r: r["untruncated_ce"])["candidate"]


def test_candidates_are_checked_when_the_config_loads(tmp_path):
    with pytest.raises(ValueError, match=r"candidates\[1\] sets \['alpah'\]"):
        DistillConfig(candidates=[{"alpha": 1.0}, {"alpah": 1.0}])
    with pytest.raises(ValueError, match=r"(?s)candidates\[0\].*alpha = 2"):
        DistillConfig(candidates=[{"alpha": 2}, {"alpha": 1.0}])
    with pytest.raises(ValueError, match="same settings"):
        DistillConfig(candidates=[{"alpha": 1.0}, {"alpha": 1.0}])
    tree = tiny_pipeline_dict(tmp_path)
    tree["distill"]["candidates"] = [{"alpha": 0.5}, {"beta": -1}]
    with pytest.raises(ConfigError, match="beta"):
        config_from_dict(tree)


def test_a_setting_every_candidate_overrides_is_warned_about(caplog):
    with caplog.at_level("WARNING", logger="pipeline.config"):
        DistillConfig(alpha=0.7, candidates=[{"alpha": 0.4}, {"alpha": 1.0}])
        DistillConfig(alpha=0.7)  # no candidates (the default): alpha is used, nothing to say
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "distill.alpha set, but distill.candidates sets it too" in warned[0]


def test_dpkd_says_it_reads_alpha_not_the_candidates(caplog):
    """DPKD's KD loss takes distill.alpha: the candidates' warning must not claim they are used."""
    with caplog.at_level("WARNING", logger="pipeline.config"):
        DistillConfig(method="dpkd", alpha=0.7)  # candidates not set: nothing to say
        DistillConfig(method="dpkd", alpha=0.7, candidates=[{"alpha": 0.4}, {"alpha": 1.0}])
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "distill.method=dpkd trains one DP-SGD student and never reads it" in warned[0]
    assert "distill.alpha" in warned[0] and "each candidate's value is used" not in warned[0]


def test_spearman_and_the_criterion_study():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2], [1, 2]) is None
    assert spearman([1, 1, 2], [3, 3, 5]) == pytest.approx(1.0)  # ties share their rank
    rows = [{"candidate": "a", "teacher_kl": 0.1, "untruncated_ce": 3.0, "synthetic_validation_ce": 2.9,
             "test_perplexity": 160.0},
            {"candidate": "b", "teacher_kl": 0.3, "untruncated_ce": 3.2, "synthetic_validation_ce": 2.3,
             "test_perplexity": 190.0},
            {"candidate": "c", "teacher_kl": 0.2, "untruncated_ce": 3.1, "synthetic_validation_ce": 2.5,
             "test_perplexity": 170.0}]
    study = criterion_study(rows)
    assert study["teacher_kl"] == {"spearman": pytest.approx(1.0), "chooses": "a", "regret": 0.0}
    assert study["synthetic_validation_ce"]["chooses"] == "b"
    assert study["synthetic_validation_ce"]["regret"] == pytest.approx(30.0)
    assert study["synthetic_validation_ce"]["spearman"] == pytest.approx(-1.0)
    assert np.isfinite(study["untruncated_ce"]["spearman"])


def test_the_criterion_study_against_the_text_alone_can_disagree_with_the_windowed_one():
    """SmolLM2 on the airline tweets (docs/real_model.md, run r1, since withdrawn, in git history): α = 0.4 won on the windowed
    figure by the code header alone, which the KL skips; on the text alone α = 1, the rule's
    choice, was the better candidate. The evaluation records both studies."""
    from pipeline.stages.evaluate import _selection_table

    selection = {"chosen": "alpha=1.0", "candidates": [
        {"candidate": "alpha=0.4", "teacher_kl": 1.907, "untruncated_ce": 5.639, "synthetic_validation_ce": 3.172},
        {"candidate": "alpha=1.0", "teacher_kl": 1.686, "untruncated_ce": 5.757, "synthetic_validation_ce": 3.493}]}
    metrics = {"candidate alpha=0.4": {"windowed": 158.7, "text_only": {"windowed": 382.2}},
               "student_distil": {"windowed": 183.1, "text_only": {"windowed": 342.1}}}
    table = _selection_table(selection, metrics)
    assert [r["test_text_perplexity"] for r in table["candidates"]] == [382.2, 342.1]
    assert table["criterion_study"]["teacher_kl"]["regret"] == pytest.approx(24.4)
    assert table["criterion_study_text"]["teacher_kl"] == {"spearman": None, "chooses": "alpha=1.0", "regret": 0.0}
    assert table["criterion_study_text"]["untruncated_ce"]["regret"] == pytest.approx(40.1)


# --- A planted case where the better candidate has α < 1 (issue 37 item 2) -----------------------
#
# The "real" distribution is a tiny model R; the DP teacher is R at temperature 2 (its logits
# halved: an under-confident teacher); generation samples the teacher at temperature 0.5, which
# is R exactly, so the synthetic text is better than the teacher that wrote it. The held-out
# records are R's samples (token ids, so that no re-tokenisation changes their distribution).
# Three students start as copies of the teacher: α = 0 learns the synthetic text and moves
# towards R, α = 1 learns the teacher and stays it. α < 1 is better on held-out records.
#
# Why teacher_kl cannot choose it: the score is E_{x ~ teacher}[KL(teacher(.|x<t) || student(.|x<t))],
# ≥ 0 and 0 only for a student equal to the teacher where it samples. It reads the teacher and
# the student and nothing else, so it ranks candidates by their distance to the teacher; what
# the held-out records say never enters. α = 1 minimises that distance directly (its loss is the
# same KL on the synthetic prefixes), so whenever α = 1 fits the teacher better than α < 1 does,
# the rule keeps α = 1, however much better an α < 1 student predicts real text. It can say no
# to α = 1 only when α = 1 under-fits the teacher, never because the teacher is wrong.

PLANTED_ALPHAS = (0.0, 0.4, 1.0)
PLANTED_CODES = {"Category: A": 3, "Category: B": 1}


def _tempered(model, factor: float, path, tok):
    """`model` with its logits multiplied by `factor` (the final layer norm scaled), saved to `path`."""
    with torch.no_grad():
        model.transformer.ln_f.weight.mul_(factor)
        model.transformer.ln_f.bias.mul_(factor)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@torch.no_grad()
def _nll(model, rows: list[tuple[list[int], int]], text_only: bool) -> float:
    """Mean next-token NLL over `rows` (token ids, prompt length); `text_only`: the header left out."""
    model.eval()
    total = count = 0.0
    for ids, n_prompt in rows:
        x = torch.tensor([ids])
        nll = -torch.log_softmax(model(x).logits[0, :-1].float(), -1).gather(1, x[0, 1:, None])[:, 0]  # (L-1,)
        kept = nll[n_prompt - 1:] if text_only else nll
        total, count = total + float(kept.sum()), count + len(kept)
    return total / count


@pytest.fixture(scope="module")
def planted(tiny_tokenizer, tmp_path_factory):
    from pipeline.config import GenerateConfig
    from pipeline.stages.generate import generate_synthetic

    tmp, tok = tmp_path_factory.mktemp("planted"), tiny_tokenizer
    torch.manual_seed(0)
    real = _tempered(make_tiny_model(tok), 20.0, tmp / "real", tok)  # a peaked random model: R
    teacher = _tempered(load_causal_lm(str(real)), 0.5, tmp / "teacher", tok)  # R at temperature 2
    codes = tmp / "codes.json"
    codes.write_text(json.dumps({"counts": PLANTED_CODES}))
    whole = dict(top_k=0, top_p=1.0, max_length=32, batch_size=100)
    synthetic = generate_synthetic(GenerateConfig(num_samples=300, temperature=0.5, validation_fraction=0.1, **whole),
                                   teacher_dir=teacher, control_codes_path=codes, ledger=[], out_dir=tmp / "syn", seed=0)
    held = generate_synthetic(GenerateConfig(num_samples=400, validation_fraction=0.0, **whole), teacher_dir=real,
                              control_codes_path=codes, ledger=[], out_dir=tmp / "held", seed=1)
    table = pq.read_table(held.shards[0])
    rows = list(zip(table["token_ids"].to_pylist(), table["n_prompt_tokens"].to_pylist()))
    student = tmp / "student"
    shutil.copytree(teacher, student)
    cfg = DistillConfig(candidates=[{"alpha": a} for a in PLANTED_ALPHAS], batch_size=16, epochs=2,
                        learning_rate=3e-3, eval_every=1000, log_every=1000, selection_samples=64,
                        keep_candidates=True)  # select_by: the default, the zero-cost rule
    result = distill(cfg, synthetic_path=synthetic.path, teacher_dir=teacher, student_model=str(student),
                     out_dir=tmp / "out", seed=0)
    students = {name: load_causal_lm(str(path)).eval() for name, path in result.candidates.items()}
    validation, test = rows[:200], rows[200:]
    return {"selection": result.selection, "students": students, "validation": validation,
            "teacher": load_causal_lm(str(teacher)).eval(), "tok": tok,
            "test": {name: _nll(s, test, text_only=False) for name, s in students.items()},
            "test_text": {name: _nll(s, test, text_only=True) for name, s in students.items()}}


def test_the_planted_case_has_its_better_candidate_below_alpha_1(planted):
    """The premise: on held-out records, whole and with the header left out, every α < 1
    candidate beats α = 1, which stays the (under-confident) teacher; α = 0 is the best on whole
    records (on the text alone α = 0 and 0.4 tie)."""
    for losses in (planted["test"], planted["test_text"]):
        assert min(losses, key=losses.get) != "alpha=1.0"
        assert all(losses[f"alpha={a}"] < losses["alpha=1.0"] - 0.2 for a in PLANTED_ALPHAS if a < 1), losses
    assert min(planted["test"], key=planted["test"].get) == "alpha=0.0"
    assert planted["selection"]["select_by"] == "teacher_kl"  # the shipped default


@pytest.mark.xfail(strict=True, reason=(
    "teacher_kl ranks students by their distance to the DP teacher and reads nothing else, so it "
    "keeps the student nearest the teacher (α = 1 here) even where the teacher predicts real text "
    "worse than its own synthetic text does (the argument above this test)"))
def test_the_zero_cost_rule_keeps_the_better_candidate_below_alpha_1(planted):
    test = planted["test"]
    assert planted["selection"]["chosen"] == min(test, key=test.get)


def test_what_each_criterion_chooses_in_the_planted_case(planted):
    """teacher_kl keeps α = 1. synthetic_validation_ce (the CE on held-out synthetic text, which
    is R's) keeps the best candidate. untruncated_ce keeps an α < 1 candidate, but only through
    the header: the control-code prompt is given, not sampled from the teacher, and α < 1 learned
    the synthetic headers; on the sampled positions alone it ranks α = 1 first, as teacher_kl
    does (CE = KL + the teacher's entropy there). The private route (noisy loss on held-out
    records) keeps an α < 1 candidate, by many noise sds at ε = 1 over 200 records."""
    rows, test = planted["selection"]["candidates"], planted["test"]
    assert choose(rows, "teacher_kl") == "alpha=1.0" == planted["selection"]["chosen"]
    assert choose(rows, "synthetic_validation_ce") == min(test, key=test.get) == "alpha=0.0"
    assert choose(rows, "untruncated_ce") != "alpha=1.0"

    from pipeline.prompts import header
    from pipeline.stages.sampling import sample_untruncated

    tok, teacher = planted["tok"], planted["teacher"]
    n_prompt = len(tok.encode(header("Category: A"), add_special_tokens=False))
    assert n_prompt == len(tok.encode(header("Category: B"), add_special_tokens=False))
    samples = sample_untruncated(teacher, tok, {c: k / 4 for c, k in PLANTED_CODES.items()}, 64, 32, seed=3)
    sampled_ce = {name: _nll(s, [(ids, n_prompt) for ids in samples], text_only=True)
                  for name, s in planted["students"].items()}
    assert min(sampled_ce, key=sampled_ce.get) == "alpha=1.0", sampled_ce

    from pipeline.privacy import private_selection
    from pipeline.tokenized import TokenIds

    validation = planted["validation"]
    z, accountant = private_selection.calibrate(1.0, 1e-5, len(PLANTED_ALPHAS), "prv")
    entry = private_selection.ledger_entry(z=z, candidates=len(PLANTED_ALPHAS), n=len(validation), clip=10.0,
                                           target_epsilon=1.0, delta=1e-5, accountant=accountant, unit="record",
                                           secure=False)
    records = TokenIds(pa.chunked_array([pa.array([ids for ids, _ in validation])]), 64, tok.pad_token_id)
    scorer = private_selection.Scorer(records, list(range(len(validation))), len(validation), 10.0, z, entry, False)
    noisy = scorer.release(planted["students"], 32, lambda: torch.autocast("cpu", enabled=False))
    sd = z * 10.0 / len(validation)
    assert choose([{"candidate": k, "private_validation": v} for k, v in noisy.items()],
                  "private_validation") != "alpha=1.0"
    exact = {}  # the clipped means the noise is added to: a study figure, never released
    for name, s in planted["students"].items():
        nll, count = nll_by_owner(s, records, scorer.owners, scorer.n, 32)
        exact[name] = float((nll / count).clip(0, 10.0).mean())
    assert min(exact[n] for n in exact if n != "alpha=1.0") < exact["alpha=1.0"] - 5 * sd, (exact, sd)
