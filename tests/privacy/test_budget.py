"""The privacy budget of one dataset across runs: every DP release on the same data, composed."""

from __future__ import annotations

import hashlib
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
    exact = LedgerEntry(stage="control_codes", private=False, epsilon=None, note="exact counts")
    with pytest.raises(ValueError, match="only a DP release"):
        record_release(tmp_path, SHA, release_id="c" * 64, stage="control-codes", run_dir=tmp_path, entry=exact)
    with pytest.raises(ValueError, match="not a sha256"):
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

    root = tmp_path / "runs"
    run = root / "tiny-1"
    run.mkdir(parents=True)
    entry = _teacher(1.0, 30)
    write_ledger(run / "ledger.json", PrivacyLedger(entries=[entry], total=compose([entry], "prv", DELTA)))
    atomic_write_json(run / "run.json", {"tool": "dpdistill", "run_root": str(root), "dataset_sha256": SHA})
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
