"""The privacy budget of one dataset across runs: every DP release on the same data, composed."""

from __future__ import annotations

import hashlib
import hmac
import json
import os

import pytest

from flows.artifacts import ledger_summary
from flows.cli import main
from pipeline.privacy.budget import budget_path, dataset_total, read_budget, record_release
from pipeline.privacy.ledger import LedgerEntry, PrivacyLedger, compose, read_ledger, write_ledger
from pipeline.manifest import atomic_write_json
from pipeline.privacy.accountant import epsilon_of

SHA = hashlib.sha256(b"the private training file").hexdigest()
DELTA = 1e-3


def _teacher(sigma: float, steps: int, unit: str = "record") -> LedgerEntry:
    history = [(sigma, 0.1, steps)]
    return LedgerEntry(
        stage="teacher", private=True, epsilon=epsilon_of("prv", history, DELTA), delta=DELTA, accountant="prv",
        mechanism="subsampled_gaussian", noise_multiplier=sigma, sample_rate=0.1, steps=steps, max_grad_norm=1.0,
        privacy_unit=unit, history=history, note="DP-SGD",
    )


def test_two_teacher_releases_compose_and_a_repeat_is_not_counted(tmp_path):
    first, second = _teacher(1.0, 30), _teacher(1.2, 40)
    budget, new = record_release(tmp_path, SHA, release_id="a" * 64, stage="teacher", run_dir=tmp_path / "r1",
                                 entry=first)
    assert new and len(budget.releases) == 1
    one = dataset_total(budget, "prv", DELTA)
    assert one.epsilon == pytest.approx(first.epsilon, rel=1e-6)

    budget, new = record_release(tmp_path, SHA, release_id="b" * 64, stage="teacher", run_dir=tmp_path / "r2",
                                 entry=second)
    assert new and len(budget.releases) == 2
    # The same outputs again (a cached or reused teacher) are the same release.
    again, new = record_release(tmp_path, SHA, release_id="a" * 64, stage="teacher", run_dir=tmp_path / "r3",
                                entry=first)
    assert not new and again == budget == read_budget(tmp_path, SHA)

    total = dataset_total(budget, "prv", DELTA)
    # Composed jointly by the accountant, exactly as a run's total would compose the two.
    assert total.epsilon == pytest.approx(compose([first, second], "prv", DELTA).epsilon)
    assert max(first.epsilon, second.epsilon) < total.epsilon < first.epsilon + second.epsilon
    assert "2 DP releases" in total.note and "r1" in total.composition and "r2" in total.composition

    path = budget_path(tmp_path, SHA)
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    stored = json.loads(path.read_text())
    assert stored["releases"][1]["entry"]["history"] == [[1.2, 0.1, 40]]


def test_other_datasets_and_non_dp_releases_do_not_count(tmp_path):
    record_release(tmp_path, SHA, release_id="a" * 64, stage="teacher", run_dir=tmp_path, entry=_teacher(1.0, 30))
    assert read_budget(tmp_path, hashlib.sha256(b"other").hexdigest()).releases == []
    exact = LedgerEntry(stage="control-codes", private=False, epsilon=None, note="exact counts")
    with pytest.raises(ValueError, match="only a DP release"):
        record_release(tmp_path, SHA, release_id="c" * 64, stage="control-codes", run_dir=tmp_path, entry=exact)
    with pytest.raises(ValueError, match="not a budget id"):
        budget_path(tmp_path, "../../etc/passwd")


def test_user_and_record_level_releases_compose_at_record_level(tmp_path):
    record_release(tmp_path, SHA, release_id="a" * 64, stage="teacher", run_dir=tmp_path, entry=_teacher(1.0, 30))
    budget, _ = record_release(tmp_path, SHA, release_id="b" * 64, stage="teacher", run_dir=tmp_path,
                               entry=_teacher(1.0, 30, unit="user"))
    total = dataset_total(budget, "prv", DELTA)
    assert "record level" in total.note and total.epsilon > budget.releases[0].entry.epsilon


def test_ledger_show_and_summary_list_all_releases_on_the_dataset(tmp_path, capsys):
    root = tmp_path / "runs"
    runs = [root / "tiny-1", root / "tiny-2"]
    entries = [_teacher(1.0, 30), _teacher(1.2, 40)]
    for i, (run, entry) in enumerate(zip(runs, entries)):
        run.mkdir(parents=True)
        write_ledger(run / "ledger.json", PrivacyLedger(entries=[entry], total=compose([entry], "prv", DELTA)))
        atomic_write_json(run / "run.json", {"tool": "dpdistill", "run_root": str(root), "dataset_sha256": SHA})
        budget, _ = record_release(root, SHA, release_id=str(i) * 64, stage="teacher", run_dir=run, entry=entry)
    total = dataset_total(budget, "prv", DELTA)

    assert main(["ledger", "show", str(runs[0])]) == 0
    out = capsys.readouterr().out
    section = out.split("All releases on this dataset")[1]
    assert "tiny-1" in section and "tiny-2" in section and f"ε = {total.epsilon:.4f}" in section

    summary = ledger_summary(read_ledger(runs[1] / "ledger.json"), budget, total)
    assert "## All releases on this dataset" in summary and f"ε = {total.epsilon:.4f}" in summary
    assert "2 DP releases" in summary and "tiny-1" in summary


def test_the_dp_sgd_student_has_one_name_and_ledgers_written_before_read_under_it(tmp_path, capsys):
    """Issue 37: `ledger show` named the DP-SGD student's stage `student` in the run's ledger and
    `dp-student` in the dataset's budget (the flow stage's name, as --from, status and stages.json
    give it). New entries are `dp-student`; a ledger and a budget written before, with `student`
    and `student-validation`, read under the current names."""
    root = tmp_path / "runs"
    run = root / "tiny-1"
    run.mkdir(parents=True)
    trained = _teacher(1.0, 30).model_copy(update={"stage": "dp-student"})
    released = trained.model_copy(update={"stage": "dp-student-validation", "mechanism": "gaussian",
                                          "history": [(5.0, 1.0, 6)], "sample_rate": 1.0, "steps": 6})
    write_ledger(run / "ledger.json", PrivacyLedger(entries=[trained, released],
                                                    total=compose([trained, released], "prv", DELTA)))
    atomic_write_json(run / "run.json", {"tool": "dpdistill", "run_root": str(root), "dataset_sha256": SHA})
    record_release(root, SHA, release_id="1" * 64, stage="dp-student", run_dir=run, entry=trained)
    record_release(root, SHA, release_id="1" * 64 + ":validation", stage="dp-student-validation", run_dir=run,
                   entry=released)
    for path in (run / "ledger.json", budget_path(root, SHA)):  # as the code before issue 37 wrote them
        old = path.read_text().replace('"dp-student-validation"', '"student-validation"')
        path.write_text(old.replace('"stage": "dp-student"', '"stage": "student"'))
    assert '"student"' in (run / "ledger.json").read_text() and '"student-validation"' in budget_path(root, SHA).read_text()

    ledger = read_ledger(run / "ledger.json")
    assert [e.stage for e in ledger.entries] == ["dp-student", "dp-student-validation"]
    assert ledger.entry("student") == ledger.entry("dp-student")  # an old caller's name still finds it
    assert sorted(r.stage for r in read_budget(root, SHA).releases) == ["dp-student", "dp-student-validation"]
    assert main(["ledger", "show", str(run)]) == 0
    stages = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert "dp-student" in stages and "student" not in stages and "student-validation" not in stages


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_concurrent_writers_lose_no_release(tmp_path):
    """Four processes recording at once: the lock keeps every release."""
    pids = []
    for i in range(4):
        pid = os.fork()
        if pid == 0:
            try:
                record_release(tmp_path, SHA, release_id=str(i) * 64, stage="teacher", run_dir=tmp_path,
                               entry=_teacher(1.0, 10 + i))
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    assert len(read_budget(tmp_path, SHA).releases) == 4


def test_ledger_show_reads_the_stored_total_without_the_accountant(tmp_path):
    """The total a run's accountant composed at its end is kept in the budget file: `ledger
    show` prints it without importing Opacus or torch (issue 10: under 2 s). A later release
    makes it stale, and then the total is composed again."""
    from pipeline.privacy.budget import store_total, stored_total
    from cli_probe import _cli

    entry = _teacher(1.0, 30)
    root, run = _run_with_ledger(tmp_path, [entry])
    budget, _ = record_release(root, SHA, release_id="1" * 64, stage="teacher", run_dir=run, entry=entry)
    total = dataset_total(budget, "prv", DELTA)
    store_total(root, SHA, "prv", DELTA, total)
    assert stored_total(read_budget(root, SHA), "prv", DELTA) == total

    rc, out, err, heavy = _cli("ledger", "show", str(run))
    assert rc == 0, err
    assert f"TOTAL: ε = {total.epsilon:.4f}" in out and not {"opacus", "torch"} & set(heavy), heavy

    budget, _ = record_release(root, SHA, release_id="2" * 64, stage="teacher", run_dir=run, entry=_teacher(1.2, 40))
    assert stored_total(budget, "prv", DELTA) is None  # other releases now: composed again
    rc, out, err, heavy = _cli("ledger", "show", str(run))
    assert rc == 0 and f"TOTAL: ε = {dataset_total(budget, 'prv', DELTA).epsilon:.4f}" in out and "opacus" in heavy


# --- keyed by the records (issue 21 item 4) ----------------------------------------------

def _run_with_ledger(tmp_path, entries: list[LedgerEntry]):
    """(run root, run directory) of a finished run whose ledger holds `entries`, on the SHA records."""
    root = tmp_path / "runs"
    run = root / "tiny-1"
    run.mkdir(parents=True)
    write_ledger(run / "ledger.json", PrivacyLedger(entries=entries, total=compose(entries, "prv", DELTA)))
    atomic_write_json(run / "run.json", {"tool": "dpdistill", "run_root": str(root), "dataset_sha256": SHA})
    return root, run


def _records(n: int, start: int = 0) -> tuple[list[str], list[str]]:
    return [f"code {i % 3}" for i in range(start, start + n)], [f"review number {i}" for i in range(start, start + n)]


def _digests(root, records):
    from pipeline.privacy.budget import record_digests, records_key

    return record_digests(*records, records_key(root))


def test_a_copy_with_one_byte_changed_past_the_rows_used_lands_in_the_same_budget(tmp_path):
    """The file's sha256 differs, the training records do not: one budget, and its key is 0600 in
    a 0700 folder outside the run root."""
    from conftest import YELP_DOMAIN, YELP_TRAIN
    from pipeline.config import DataConfig
    from pipeline.manifest import sha256_file
    from pipeline.privacy.budget import BUDGET_DIR, KEY_ID_FILE, key_dir, register_records
    from pipeline.records import read_split, split_key
    from pipeline.stages.data import with_training_split

    copy = tmp_path / "copy.csv"
    data = bytearray(YELP_TRAIN.read_bytes())
    data[-2] = ord("X") if data[-2] != ord("X") else ord("Y")  # in the last row, far past the 120 used
    copy.write_bytes(bytes(data))
    assert sha256_file(copy) != sha256_file(YELP_TRAIN)
    root = tmp_path / "runs"
    split_key(root)  # made by the first run under root; the plan reads it
    ids = [register_records(root, _digests(root, with_training_split(DataConfig(path=p, max_records=120), root, YELP_DOMAIN,
                                                                      read_split)))
           for p in (YELP_TRAIN, copy)]
    assert ids[0] == ids[1]
    key = key_dir() / f"{(root / BUDGET_DIR / KEY_ID_FILE).read_text()}.key"
    assert key.stat().st_mode & 0o777 == 0o600 and key.parent.stat().st_mode & 0o777 == 0o700
    assert not key.resolve().is_relative_to(root.resolve())
    # The stored digests are keyed: the plain sha256 of a record is nowhere in them.
    codes, texts = with_training_split(DataConfig(path=YELP_TRAIN, max_records=120), root, YELP_DOMAIN, read_split)
    stored = (root / BUDGET_DIR / f"{ids[0]}.records").read_text()
    assert hashlib.sha256(json.dumps([codes[0], texts[0]]).encode()).hexdigest()[:32] not in stored


def test_an_overlapping_subset_is_charged_and_inherits_earlier_releases(tmp_path):
    from pipeline.privacy.budget import register_records

    root = tmp_path / "runs"
    first = register_records(root, _digests(root, _records(100)))
    record_release(root, first, release_id="a" * 64, stage="teacher", run_dir=root / "r1", entry=_teacher(1.0, 30))
    # Records 50..149: half of them were in the first run's training split.
    overlap = register_records(root, _digests(root, _records(100, start=50)))
    apart = register_records(root, _digests(root, _records(10, start=1000)))
    assert [r.release_id for r in read_budget(root, overlap).releases] == ["a" * 64]
    assert read_budget(root, apart).releases == []

    budget, new = record_release(root, overlap, release_id="b" * 64, stage="teacher", run_dir=root / "r2",
                                 entry=_teacher(1.2, 40))
    assert new and [r.release_id for r in budget.releases] == ["a" * 64, "b" * 64]
    assert [r.release_id for r in read_budget(root, first).releases] == ["a" * 64, "b" * 64]  # charged too
    assert read_budget(root, apart).releases == []
    # A later subset of the first split starts with both releases, each once.
    subset = register_records(root, _digests(root, _records(20, start=60)))
    assert sorted(r.release_id for r in read_budget(root, subset).releases) == ["a" * 64, "b" * 64]


def test_a_run_over_max_epsilon_is_refused_before_training_and_in_plan(tmp_path, tiny_model_dir):
    """privacy.max_epsilon: the teacher stage refuses before it trains (its directory never
    appears), naming the field, the current total and the fix; `plan` refuses the same run."""
    from conftest import tiny_pipeline_dict
    from flows.cli_plan import planned_budget
    from flows.tasks import _dp_train
    from pipeline.config import config_from_dict
    from pipeline.plan import make_plan
    from pipeline.privacy.budget import BudgetExceeded, record_digests, records_key, register_records
    from pipeline.records import read_split
    from pipeline.stages.data import prepare_data

    tree = tiny_pipeline_dict(tmp_path)
    tree["teacher"].update(model=str(tiny_model_dir), max_length=64)
    tree["privacy"] = {"max_epsilon": 10.0}
    cfg = config_from_dict(tree)
    data = prepare_data(cfg.data, tmp_path / "data", code_domain=cfg.control_codes.domain)
    root = cfg.run_root.resolve()
    plan = make_plan(cfg)
    from pipeline.privacy.budget import budget_of
    from pipeline.stages.data import planned_split

    def planned(cfg):  # as `dpdistill plan` reads it: the records' budget from the plan's one split
        return planned_split(cfg.data, root, cfg.control_codes.domain, lambda train: budget_of(root, train))[1]
    assert "within privacy.max_epsilon=10" in planned_budget(cfg, plan, planned(cfg))  # nothing spent yet: 8 + 1 fits

    budget_id = register_records(root, record_digests(*read_split(data.train), records_key(root)))
    earlier = next(e for e in plan.entries if e.stage == "teacher")
    record_release(root, budget_id, release_id="e" * 64, stage="teacher", run_dir=root / "earlier", entry=earlier)
    spent = dataset_total(read_budget(root, budget_id), "prv", plan.total.delta)

    with pytest.raises(BudgetExceeded) as refused:
        _dp_train(cfg, data, tmp_path / "run", stage="teacher", model=str(tiny_model_dir), plan=plan)
    message = str(refused.value)
    assert "privacy.max_epsilon=10.0" in message and f"ε = {spent.epsilon:.4f}" in message
    assert "Fix: lower teacher.target_epsilon" in message and "raise privacy.max_epsilon" in message
    assert not (tmp_path / "run" / "teacher").exists()
    with pytest.raises(BudgetExceeded, match="privacy.max_epsilon=10.0"):
        planned_budget(cfg, plan, planned(cfg))


def test_digests_streamed_from_a_split_file_match_and_read_budgets_written_before(tmp_path):
    """`split_digests` streams a split file to the digests of its records (sorted, each once);
    a budget written by the set-based code before it (hex lines, named by the HMAC of the
    joined hex) has the same id and its records are found again, digests ending in zero bytes
    included (numpy drops those from a bytes item)."""
    from pipeline.privacy.budget import BUDGET_DIR, record_digests, records_key, register_records, split_digests
    from pipeline.stages.data import _write_split

    codes, texts = _records(3000)
    codes, texts = codes + codes[:5], texts + texts[:5]  # exact copies: one digest each
    split = tmp_path / "train.parquet"
    _write_split(split, codes, texts, None)
    root = tmp_path / "runs"
    key = records_key(root)
    digests = split_digests(split, key)
    assert (digests == record_digests(codes, texts, key)).all() and len(digests) == 3000

    old = {hmac.new(key, json.dumps([c, t]).encode(), hashlib.sha256).hexdigest()[:32] for c, t in zip(codes, texts)}
    old_id = hmac.new(key, "\n".join(sorted(old)).encode(), hashlib.sha256).hexdigest()
    assert any(d.endswith("00") for d in old)  # ~12 of 3,000 expected
    assert register_records(root, digests) == old_id
    assert (root / BUDGET_DIR / f"{old_id}.records").read_text() == "\n".join(sorted(old)) + "\n"
    record_release(root, old_id, release_id="c" * 64, stage="teacher", run_dir=root / "r1", entry=_teacher(1.0, 30))
    ending_in_zero = [i for i, (c, t) in enumerate(zip(codes, texts))
                      if hmac.new(key, json.dumps([c, t]).encode(), hashlib.sha256).digest()[15] == 0]
    one = register_records(root, record_digests([codes[ending_in_zero[0]]], [texts[ending_in_zero[0]]], key))
    assert [r.release_id for r in read_budget(root, one).releases] == ["c" * 64]


def _release(mechanism: str, sigma: float, q: float, steps: int, delta: float) -> LedgerEntry:
    history = [(sigma, q, steps)]
    return LedgerEntry(stage="teacher" if mechanism == "subsampled_gaussian" else "control-codes", private=True,
                       epsilon=epsilon_of("prv", history, delta), delta=delta, accountant="prv", mechanism=mechanism,
                       noise_multiplier=sigma, sample_rate=q, steps=steps, privacy_unit="record", history=history,
                       note="DP")


def test_the_budget_is_composed_and_checked_at_the_delta_its_first_run_fixed(tmp_path, capsys):
    """Issue 38 item 4: the demo's two releases (histogram σ 6.25, teacher σ 1.284, q 1/12, 36 steps)
    counted ε 2.066 at its δ = 7.0e-5 but 1.798 in a run on a subset of its records at δ = 2.63e-4,
    so a subset run was checked against privacy.max_epsilon at a δ of its own choosing. The first
    run fixes the budget's δ: a subset run composes, checks and shows the same releases at it."""
    from pipeline.privacy.budget import BudgetExceeded, check_max_epsilon, register_records

    demo_delta, subset_delta = 7.0e-5, 2.63e-4
    root = tmp_path / "runs"
    full = register_records(root, _digests(root, _records(100)))
    demo = [_release("gaussian", 6.25, 1.0, 1, demo_delta),
            _release("subsampled_gaussian", 1.284, 1 / 12, 36, demo_delta)]
    for i, entry in enumerate(demo):
        record_release(root, full, release_id=str(i) * 64, stage=entry.stage, run_dir=root / "demo", entry=entry)
    subset = register_records(root, _digests(root, _records(30, start=10)))
    budget = read_budget(root, subset)
    assert budget.delta == read_budget(root, full).delta == demo_delta

    spent = dataset_total(budget, "prv", subset_delta)
    assert spent.delta == demo_delta and spent.epsilon == pytest.approx(2.066, abs=2e-3)
    assert compose(demo, "prv", subset_delta).epsilon == pytest.approx(1.798, abs=2e-3)  # the finding's figure

    # A small release planned at the subset's δ: within 2.0 at that δ (the old check passed it),
    # past it at the budget's δ, and the refusal names both.
    planned = [_release("gaussian", 40.0, 1.0, 1, subset_delta)]
    assert dataset_total(budget.model_copy(update={"delta": subset_delta}), "prv", subset_delta, planned).epsilon < 2.0
    with pytest.raises(BudgetExceeded) as refused:
        check_max_epsilon(budget, planned, 2.0, "prv", subset_delta)
    message = str(refused.value)
    assert "at δ = 7e-05, the δ of these records' budget, fixed by the first run" in message
    assert "this run's own δ is 0.000263" in message

    # The subset run's release is charged at its own δ, the budget keeps the first one, and
    # `ledger show` of the subset run totals at it.
    run = root / "subset-run"
    run.mkdir()
    write_ledger(run / "ledger.json", PrivacyLedger(entries=planned, total=compose(planned, "prv", subset_delta)))
    atomic_write_json(run / "run.json", {"tool": "dpdistill", "run_root": str(root), "records_id": subset})
    budget, _ = record_release(root, subset, release_id="s" * 64, stage="control-codes", run_dir=run, entry=planned[0])
    assert budget.delta == demo_delta and json.loads(budget_path(root, subset).read_text())["delta"] == demo_delta
    assert main(["ledger", "show", str(run)]) == 0
    total = dataset_total(budget, "prv", subset_delta)
    assert f"TOTAL: ε = {total.epsilon:.4f}, replace-one ε = {total.epsilon_replace_one:.4g}, δ = 7e-05" \
        in capsys.readouterr().out


# --- the key is not kept beside the digests (issue 38 item 5) ----------------------------

def _is_member(privacy_copy, key: bytes, record: tuple[str, str]) -> bool:
    """The attack: a candidate record's keyed digest looked up in every `.records` file."""
    digest = hmac.new(key, json.dumps(list(record)).encode(), hashlib.sha256).hexdigest()[:32]
    return any(digest in p.read_text().split() for p in privacy_copy.glob("*.records"))


def _keys_in(folder) -> list[bytes]:
    """Every file of `folder` that could be a key: 64 hex digits."""
    out = []
    for p in folder.rglob("*"):
        text = p.read_text().strip() if p.is_file() else ""
        if len(text) == 64 and all(c in "0123456789abcdef" for c in text):
            out.append(bytes.fromhex(text))
    return out


def test_a_copy_of_the_privacy_folder_cannot_test_a_record_for_membership(tmp_path):
    """Issue 38 item 5: `.privacy/records.key` sat beside the HMAC digests of every training
    record, both outliving the deleted splits: a copy of the folder told whether a candidate
    record was trained on. Now the copy has no key; with the key (outside the run root) the same
    attack works, so the test can see it."""
    import shutil

    from pipeline.privacy import budget
    from pipeline.privacy.budget import BUDGET_DIR, register_records

    root = tmp_path / "runs"
    codes, texts = _records(50)
    register_records(root, _digests(root, (codes, texts)))
    stolen = tmp_path / "stolen"
    shutil.copytree(root / BUDGET_DIR, stolen)
    member, outsider = (codes[7], texts[7]), ("code 1", "review number 5000")

    assert _keys_in(stolen) == []
    assert not any(_is_member(stolen, key, member) for key in _keys_in(root))  # nor anywhere in the run root
    key = bytes.fromhex((budget.key_dir() / f"{(stolen / budget.KEY_ID_FILE).read_text()}.key").read_text())
    assert _is_member(stolen, key, member) and not _is_member(stolen, key, outsider)


def test_a_key_kept_beside_the_digests_is_moved_out_once_and_the_budget_kept(tmp_path, caplog):
    """A run root made before issue 38 keeps its budgets: its key moves to the key folder, once, saying so."""
    from pipeline.privacy.budget import BUDGET_DIR, KEY_ID_FILE, OLD_KEY_FILE, existing_records_key, key_dir, \
        record_digests, records_key, register_records

    root = tmp_path / "runs"
    folder = root / BUDGET_DIR
    folder.mkdir(parents=True)
    (folder / OLD_KEY_FILE).write_text("ab" * 32)
    old = bytes.fromhex("ab" * 32)
    assert existing_records_key(root) == old and (folder / OLD_KEY_FILE).is_file()  # `plan` moves nothing
    with caplog.at_level("WARNING", logger="pipeline.privacy.budget"):
        before = register_records(root, record_digests(*_records(5), old))  # a budget keyed by the old key
    assert not (folder / OLD_KEY_FILE).exists()
    assert (key_dir() / f"{(folder / KEY_ID_FILE).read_text()}.key").read_text() == "ab" * 32
    assert len([r for r in caplog.records if "moved to" in r.getMessage()]) == 1
    caplog.clear()
    assert records_key(root) == old and existing_records_key(root) == old and not caplog.records  # once
    assert register_records(root, _digests(root, _records(5))) == before  # the same budget


def test_an_unreadable_key_stops_with_how_to_fix_it(tmp_path, monkeypatch):
    """A key folder that moved (another machine, a container without its volume): one error
    naming where the key should be and the variable that points at it, never a fresh key (a
    fresh one would start every budget of the run root from zero)."""
    from pipeline.privacy.budget import KEY_DIR_ENV, RecordsKeyError, budget_of, records_key

    root = tmp_path / "runs"
    key = records_key(root)
    monkeypatch.setenv(KEY_DIR_ENV, str(tmp_path / "elsewhere"))
    with pytest.raises(RecordsKeyError) as refused:
        records_key(root)
    message = str(refused.value)
    assert str(tmp_path / "elsewhere") in message and f"set {KEY_DIR_ENV}" in message and "Fix: restore" in message
    with pytest.raises(RecordsKeyError):
        budget_of(root, tmp_path / "train.parquet")  # `plan` too
    monkeypatch.undo()
    assert records_key(root) == key


def test_ledger_show_gives_the_replace_one_epsilon_of_every_release_on_the_dataset(tmp_path, capsys):
    """Issue 62 item 4: the teacher-validation entry (teacher.monitor=dp, pipeline/privacy/monitor.py)
    reaches the budget without its replace-one ε, and `ledger show`'s dataset table printed "-" for
    it. A release is recorded with it now, and a budget written before gets it when shown."""
    from pipeline.privacy.monitor import gaussian_entry

    root = tmp_path / "runs"
    run = root / "tiny-1"
    run.mkdir(parents=True)
    teacher = _teacher(1.0, 30)
    released = gaussian_entry("teacher-validation", z=5.0, releases=6, delta=DELTA, accountant="prv",
                              unit="record", secure=True, note="validation loss")
    assert released.epsilon_replace_one is None  # as the monitor makes it
    write_ledger(run / "ledger.json", PrivacyLedger(entries=[teacher, released],
                                                    total=compose([teacher, released], "prv", DELTA)))
    atomic_write_json(run / "run.json", {"tool": "dpdistill", "run_root": str(root), "dataset_sha256": SHA})
    record_release(root, SHA, release_id="1" * 64, stage="teacher", run_dir=run, entry=teacher)
    budget, _ = record_release(root, SHA, release_id="1" * 64 + ":validation", stage="teacher-validation",
                               run_dir=run, entry=released)
    assert all(r.entry.epsilon_replace_one for r in budget.releases)
    stored = json.loads(budget_path(root, SHA).read_text())
    stored["releases"][1]["entry"]["epsilon_replace_one"] = None  # a budget written before the fix
    budget_path(root, SHA).write_text(json.dumps(stored))
    assert main(["ledger", "show", str(run)]) == 0
    section = capsys.readouterr().out.split("All releases on this dataset")[1]
    [row] = [line for line in section.splitlines() if line.startswith("teacher-validation")]
    assert row.split()[2] != "-" and float(row.split()[2]) > 0  # a clipped mean: about its add/remove ε


def test_a_release_without_dp_is_recorded_and_every_total_of_the_records_says_so(tmp_path, capsys):
    """Issue 62 item 6: the empirical audit's noise-off training (made only on request) is a release
    without DP on the records; their budget records it, and `ledger show` and every total say that
    the guarantee no longer covers everything released from them."""
    from pipeline.privacy.budget import record_non_dp_release

    entry = _teacher(1.0, 30)
    root, run = _run_with_ledger(tmp_path, [entry])
    record_release(root, SHA, release_id="1" * 64, stage="teacher", run_dir=run, entry=entry)
    budget = record_non_dp_release(root, SHA, release_id="2" * 64, stage="empirical-audit-noise-off", run_dir=run,
                                   unit="record", note="NOT DP: trained with σ = 0")
    total = dataset_total(budget, "prv", DELTA)
    assert total.epsilon == pytest.approx(entry.epsilon) and not total.complete
    assert "1 DP release" in total.note and "NOT differentially private: empirical-audit-noise-off" in total.note
    assert main(["ledger", "show", str(run)]) == 0
    section = capsys.readouterr().out.split("All releases on this dataset")[1]
    [row] = [line for line in section.splitlines() if line.startswith("empirical-audit-noise-off")]
    assert "NOT DP" in row and "NOT differentially private" in section
