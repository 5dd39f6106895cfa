"""The teacher's validation loss (teacher.monitor, issue 21 item 1): published from the private
validation split only as an accounted Gaussian release, or not at all, or on public records."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import first_record_rewritten
from pipeline.config import TeacherConfig
from pipeline.privacy import monitor, noise
from pipeline.privacy.accountant import calibrate_sigma, epsilon_of
from pipeline.privacy.ledger import LedgerEntry, compose
from pipeline.privacy.noise import TEST_SEED_ENV
from pipeline.stages.teacher.monitor import monitor_points
from pipeline.stages.teacher.recipe import train_teacher


@pytest.fixture
def fixed_noise(monkeypatch):
    """The test-only hook: DP noise, sampling and picks from a fixed seed (NOT private)."""
    monkeypatch.setenv(TEST_SEED_ENV, "1234")


def _teacher(splits, model_dir, out, **overrides):
    cfg = TeacherConfig(**{"target_epsilon": 3.0, "epochs": 1, "batch_size": 25, "physical_batch_size": 10,
                           "max_length": 48, "learning_rate": 1e-3, "log_every": 2, **overrides})
    published = []
    result = train_teacher(cfg, train_path=splits.train, validation_path=splits.validation, base_model=str(model_dir),
                           out_dir=out, seed=0, on_progress=published.append,
                           monitor_path=splits.validation if cfg.monitor == "public" else None)
    return result, published


def _one_validation_record_rewritten(splits, tmp_path):
    """The same splits, but the first validation record (a monitored one) replaced by a candidate."""
    path = first_record_rewritten(splits.validation, tmp_path / "validation_candidate.parquet",
                                  "the candidate record: five stars, the best tacos I ever had " * 3)
    return dataclasses.replace(splits, validation=path)


def _published(out, progress):
    """Everything the stage publishes, without the clock."""
    log = json.loads((out / "training_log.json").read_text())
    for h in log["history"]:
        h.pop("seconds", None)
    ledger = json.loads((out / "manifest.json").read_text())["ledger"]
    return log, [{k: v for k, v in p.items() if k != "seconds"} for p in progress], ledger


def test_monitor_none_publishes_nothing_that_depends_on_a_validation_record(splits, tiny_model_dir, tmp_path,
                                                                           fixed_noise):
    """The attack of issue 21 as a test. Two runs whose validation splits differ in one monitored
    record, everything else fixed (the noise too, by the test hook): with the default
    monitor=none the training log, the progress records and the ledger are identical, and no
    validation loss exists anywhere. Published in the clear (monitor=public pointed at the
    validation split: the old behaviour), the same one-record difference shows."""
    candidate = _one_validation_record_rewritten(splits, tmp_path)
    a, progress_a = _teacher(splits, tiny_model_dir, tmp_path / "a")
    b, progress_b = _teacher(candidate, tiny_model_dir, tmp_path / "b")
    assert _published(tmp_path / "a", progress_a) == _published(tmp_path / "b", progress_b)
    log, progress, ledger = _published(tmp_path / "a", progress_a)
    assert log["monitor"] == "none" and "validation_loss" not in log
    assert not any("validation_loss" in h for h in log["history"] + progress)
    assert any("epsilon" in h for h in log["history"])  # ε and steps are still published
    assert a.validation_loss is None and a.validation_curve == [] and a.monitor_ledger is None
    assert "validation" not in json.loads((tmp_path / "a" / "manifest.json").read_text())["inputs"]
    assert ledger["validation_monitor"] == "none" and "no figure computed from the validation split" in ledger["note"]

    clear_a, _ = _teacher(splits, tiny_model_dir, tmp_path / "clear_a", monitor="public",
                          monitor_path=splits.validation)
    clear_b, _ = _teacher(candidate, tiny_model_dir, tmp_path / "clear_b", monitor="public",
                          monitor_path=candidate.validation)
    assert [s for s, _ in clear_a.validation_curve] == [s for s, _ in clear_b.validation_curve]
    assert all(x != y for (_, x), (_, y) in zip(clear_a.validation_curve, clear_b.validation_curve))
    assert clear_a.validation_loss != clear_b.validation_loss


def test_monitor_dp_is_an_accounted_gaussian_release_composed_into_the_total(splits, tiny_model_dir, tmp_path):
    """monitor=dp: one release per monitor point (the final one included), counted before
    training; z is the accountant's for monitor_epsilon at the run's δ over those k releases at
    q = 1; the entry composes with the teacher's; only noisy values are published."""
    result, progress = _teacher(splits, tiny_model_dir, tmp_path, monitor="dp", monitor_epsilon=0.5)
    teacher, entry = result.ledger, result.monitor_ledger
    k = len(monitor_points(teacher.steps, 2))
    assert entry.stage == "teacher-validation" and entry.mechanism == "gaussian" and entry.private
    assert entry.steps == k == len(result.validation_curve) and entry.sample_rate == 1.0
    assert entry.delta == teacher.delta and entry.privacy_unit == "record"
    assert entry.noise_multiplier == calibrate_sigma("prv", 0.5, teacher.delta, sample_rate=1.0, steps=k)
    assert entry.epsilon == epsilon_of("prv", [(entry.noise_multiplier, 1.0, k)], teacher.delta) <= 0.5
    assert teacher.validation_monitor == "dp" and "teacher-validation" in teacher.note
    total = compose([teacher, entry], "prv", teacher.delta)
    assert total.epsilon == pytest.approx(epsilon_of("prv", teacher.history + entry.history, teacher.delta))
    assert total.epsilon > teacher.epsilon and "teacher-validation" in total.composition
    assert "validation loss it publishes (teacher-validation)" in total.note
    published = [p["validation_loss"] for p in progress if "validation_loss" in p]
    assert published == [loss for _, loss in result.validation_curve] and result.validation_loss == published[-1]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert LedgerEntry.model_validate(manifest["monitor_ledger"]) == entry and "validation" in manifest["inputs"]


def test_released_values_carry_noise_of_the_calibrated_size():
    """Over 2,000 draws of the mechanism itself: centred on the exact clipped mean, with sd
    z·clip/n, from the secret generator (both kinds). The keys are fresh entropy, so each bound is
    six standard errors (a false failure about once in 10^9 runs): a sample sd has relative
    standard error 1/√(2(draws-1)), 1.6 % here, so an sd wrong by 10 % still fails."""
    losses = torch.tensor([2.0, 3.5, 4.0, 50.0, 1.0, 0.5, 6.0, 3.0])  # one record above the clip
    clip, z, n, k = 10.0, 3.0, 8, 2000
    exact = losses.clamp(0, clip).double().mean().item()
    sd = z * clip / n
    for secure in (False, True):
        gen = noise.generator("monitor", secure=secure)
        draws = torch.tensor([monitor.noisy_mean(losses, clip, z, gen) for _ in range(k)], dtype=torch.float64)
        assert abs(draws.mean().item() - exact) < 6 * sd / k**0.5
        assert abs(draws.std().item() / sd - 1) < 6 / (2 * (k - 1)) ** 0.5


def test_one_record_moves_the_clipped_mean_by_at_most_clip_over_n():
    """The sensitivity the noise is calibrated to: replace any record by anything."""
    gen = noise.generator("monitor", secure=False)
    base = torch.tensor([2.0, 3.0, 4.0, 5.0])
    exact = monitor.noisy_mean(base, 10.0, 0.0, gen)  # z = 0: the clipped mean itself
    for value in (0.0, 9.9, 1e6, float("inf")):
        other = base.clone()
        other[0] = value
        assert abs(monitor.noisy_mean(other, 10.0, 0.0, gen) - exact) <= 10.0 / 4 + 1e-12


def test_user_level_units_are_each_users_mean():
    """At user level one user (all their records) is one unit of the mean: sensitivity clip/n users."""
    losses = torch.tensor([1.0, 3.0, 10.0, 4.0])
    users = torch.tensor([0, 0, 1, 1])
    torch.testing.assert_close(monitor.unit_means(losses, users), torch.tensor([2.0, 7.0], dtype=torch.float64))


def test_the_noise_is_secret_not_torchs_global_rng(monkeypatch):
    """Same global seed, fresh secret generators: other noise; the global RNG is never drawn."""
    monkeypatch.delenv(TEST_SEED_ENV, raising=False)
    losses = torch.tensor([2.0, 3.0])
    values = []
    for _ in range(2):
        torch.manual_seed(0)
        state = torch.get_rng_state()
        values.append(monitor.noisy_mean(losses, 10.0, 1.0, noise.generator("monitor", secure=False)))
        assert torch.equal(torch.get_rng_state(), state)
    assert values[0] != values[1]


def test_the_entry_says_when_the_noise_came_from_the_test_hook(splits, tiny_model_dir, tmp_path, fixed_noise):
    result, _ = _teacher(splits, tiny_model_dir, tmp_path, monitor="dp")
    assert result.monitor_ledger.noise_source.startswith("TEST HOOK")
    total = compose([result.ledger, result.monitor_ledger], "prv", result.ledger.delta)
    assert not total.complete and "teacher-validation" in total.note


def test_monitor_settings_are_checked_with_the_fix():
    with pytest.raises(ValueError, match="teacher.monitor_path"):
        TeacherConfig(monitor="public")
    with pytest.raises(ValueError, match="teacher.monitor=public"):
        TeacherConfig(monitor_path="public.csv")
    with pytest.raises(ValueError):
        TeacherConfig(monitor="dp", monitor_clip=0)
