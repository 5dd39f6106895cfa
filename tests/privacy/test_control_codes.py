"""Control codes: exact or DP release of the histogram; user-level splits and sampling."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch

from conftest import YELP_DOMAIN as DOMAIN
from conftest import YELP_TEST, YELP_TRAIN, yelp_by_users
from pipeline.privacy.control_codes import domain_codes, release_control_codes
from pipeline.config import CodesConfig, DataConfig, TeacherConfig
from pipeline.records import DataError, read_split, read_users
from pipeline.stages.data import prepare_data
from pipeline.privacy.noise import TEST_SEED_ENV
from pipeline.stages.teacher.recipe import train_teacher

@pytest.fixture(scope="module")
def yelp(tmp_path_factory):
    cfg = DataConfig(path=YELP_TRAIN, test_path=YELP_TEST, max_records=400, max_test_records=20)
    return cfg, prepare_data(cfg, tmp_path_factory.mktemp("d"), code_domain=DOMAIN)


def _release(yelp, tmp_path, secure_mode=False, **kw):
    cfg, data = yelp
    return release_control_codes(CodesConfig(**kw), cfg, train_path=data.train, out_dir=tmp_path,
                                 accountant="prv", secure_mode=secure_mode)


def test_exact_counts_come_from_the_training_split_and_are_flagged(yelp, tmp_path):
    """mechanism=exact: the true train-split counts, and a ledger entry saying NOT private."""
    _, data = yelp
    res = _release(yelp, tmp_path, mechanism="exact")
    released = json.loads(res.path.read_text())
    assert released["counts"] == dict(Counter(read_split(data.train)[0]))
    assert released["private"] is False and not res.ledger.private and res.ledger.epsilon is None


def test_gaussian_histogram_covers_the_domain_and_reports_the_accountants_epsilon(yelp, tmp_path):
    """mechanism=gaussian: ε ≤ target from the accountant; noise on every declared bin."""
    cfg, data = yelp
    res = _release(yelp, tmp_path, mechanism="gaussian", epsilon=1.0, domain=DOMAIN)
    e = res.ledger
    assert e.private and e.mechanism == "gaussian" and e.history == [(e.noise_multiplier, 1.0, 1)]
    assert 0.9 < e.epsilon <= 1.0 and e.delta == pytest.approx(1 / (10 * data.n_train))
    counts = json.loads(res.path.read_text())["counts"]
    assert set(counts) <= set(domain_codes(cfg, DOMAIN)) and len(domain_codes(cfg, DOMAIN)) == 50
    assert all(v > 0 for v in counts.values())
    exact = Counter(read_split(data.train)[0])
    # σ ≈ 4 at ε = 1: the common codes keep their order of magnitude
    top = exact.most_common(1)[0][0]
    assert abs(counts[top] - exact[top]) < 6 * e.noise_multiplier


def test_replacing_one_record_moves_the_histogram_by_root_two(yelp, tmp_path):
    """The sensitivity pipeline/privacy/pld.py accounts the Gaussian histogram at under replace-one:
    one record's code replaced by another moves one count between two bins, L2 √2 (L1 2)."""
    import pyarrow.parquet as pq

    cfg, data = yelp
    table = pq.read_table(data.train)
    codes = table["control_code"].to_pylist()
    other = next(c for c in domain_codes(cfg, DOMAIN) if c != codes[0])
    replaced = tmp_path / "replaced.parquet"
    column = table.schema.get_field_index("control_code")
    pq.write_table(table.set_column(column, "control_code", [[other] + codes[1:]]), replaced)
    bins = domain_codes(cfg, DOMAIN)

    def released(path, out):
        counts = json.loads(release_control_codes(CodesConfig(mechanism="exact"), cfg, train_path=path,
                                                  out_dir=out).path.read_text())["counts"]
        return np.array([counts.get(b, 0.0) for b in bins])

    diff = released(data.train, tmp_path / "a") - released(replaced, tmp_path / "b")
    assert np.linalg.norm(diff) == pytest.approx(math.sqrt(2)) and np.abs(diff).sum() == 2
    res = _release(yelp, tmp_path / "g", mechanism="gaussian", epsilon=1.0, domain=DOMAIN)
    from pipeline.privacy import pld
    assert res.ledger.epsilon_replace_one == pytest.approx(
        pld.epsilon([("gaussian", res.ledger.history)], res.ledger.delta, pld.REPLACE_ONE))
    assert res.ledger.epsilon < res.ledger.epsilon_replace_one


def test_geometric_histogram_is_pure_epsilon(yelp, tmp_path):
    """mechanism=geometric: pure ε (δ = 0), no accountant history: composed by addition."""
    res = _release(yelp, tmp_path, mechanism="geometric", epsilon=0.5, domain=DOMAIN)
    assert res.ledger.epsilon == 0.5 and res.ledger.delta == 0.0 and res.ledger.history == []


def test_code_outside_the_declared_domain_is_refused(tmp_path):
    """A code value not in control_codes.domain stops the data stage, naming row and column."""
    small = {"label1": DOMAIN["label1"], "label2": DOMAIN["label2"][:4]}  # no 5-star
    with pytest.raises(DataError, match=r"column 'label2': value not in control_codes.domain"):
        prepare_data(DataConfig(path=YELP_TRAIN, max_records=50), tmp_path, code_domain=small)


@pytest.fixture(scope="module")
def with_users(tmp_path_factory):
    """120 Yelp reviews attributed to 30 users (4 each), as a CSV with a user column."""
    out = tmp_path_factory.mktemp("users")
    path = yelp_by_users(out)
    cfg = DataConfig(path=path, user_column="author", validation_fraction=0.1, test_fraction=0.1)
    return cfg, prepare_data(cfg, out / "data")


def test_splits_are_made_by_user(with_users):
    """No user has records on two sides of a split; every record is kept."""
    _, data = with_users
    sides = [set(read_users(p)) for p in (data.train, data.validation, data.test)]
    assert all(not (a & b) for i, a in enumerate(sides) for b in sides[i + 1:])
    assert [len(s) for s in sides] == [24, 3, 3]
    assert data.n_train + data.n_validation + data.n_test == 120


def test_user_level_teacher_samples_users(with_users, tiny_model_dir, tmp_path):
    """User-level DP: N counts users, δ = 1/(10·users), q = batch/users, ledger says 'user'."""
    _, data = with_users
    cfg = TeacherConfig(target_epsilon=4.0, epochs=2, batch_size=6, physical_batch_size=6, max_length=48)
    res = train_teacher(cfg, train_path=data.train, validation_path=data.validation,
                        base_model=str(tiny_model_dir), out_dir=tmp_path, seed=0)
    e = res.ledger
    assert e.privacy_unit == "user" and e.delta == pytest.approx(1 / 240)
    assert e.sample_rate == pytest.approx(1 / 4) and e.steps == 8  # ceil(24 / 6) = 4 per epoch
    assert e.epsilon <= 4.0 and "one random record per sampled user" in e.note


def test_user_level_codes_take_one_record_per_user(with_users, tmp_path):
    """With users, the DP histogram counts one record per user: total ≈ number of users."""
    cfg, data = with_users
    res = release_control_codes(CodesConfig(mechanism="gaussian", epsilon=50.0, domain=DOMAIN), cfg,
                                train_path=data.train, out_dir=tmp_path, accountant="prv")
    assert res.ledger.privacy_unit == "user"
    total = sum(json.loads(res.path.read_text())["counts"].values())
    assert abs(total - 24) < 8  # 24 users; σ is small at ε = 50, floors add a little


def _released(res) -> dict[str, float]:
    return json.loads(res.path.read_text())["counts"]


def test_two_releases_with_the_same_seed_draw_other_noise(yelp, tmp_path):
    """The seed is published with the config: it must not determine the histogram noise."""
    a = _release(yelp, tmp_path / "a", mechanism="gaussian", epsilon=1.0, domain=DOMAIN)
    b = _release(yelp, tmp_path / "b", mechanism="gaussian", epsilon=1.0, domain=DOMAIN)
    assert _released(a) != _released(b)
    assert a.ledger.noise_source.startswith("os-entropy")


@pytest.mark.parametrize("mechanism", ["gaussian", "geometric"])
def test_the_published_seed_does_not_regenerate_the_noise(yelp, tmp_path, mechanism):
    """The attack: draw the noise again from the published seed, as the release used to, and
    subtract it. Before, every released count came back exact; now (almost) none does
    (integer geometric noise matches by chance in about 13% of bins at ε = 0.5)."""
    cfg, data = yelp
    res = _release(yelp, tmp_path, mechanism=mechanism, epsilon=0.5, domain=DOMAIN)
    bins = domain_codes(cfg, DOMAIN)
    rng = np.random.default_rng(0)  # config seed 0, the same calls as the old release
    if mechanism == "gaussian":
        guess = rng.normal(0.0, res.ledger.noise_multiplier, size=len(bins))
    else:
        p = 1.0 - math.exp(-0.5)
        guess = rng.geometric(p, len(bins)) - rng.geometric(p, len(bins))
    exact = Counter(read_split(data.train)[0])
    released = _released(res)
    recovered = [abs(released[b] - g - exact.get(b, 0)) < 1e-6 for b, g in zip(bins, guess) if b in released]
    assert len(recovered) > 10
    assert sum(recovered) <= (0 if mechanism == "gaussian" else len(recovered) // 2)


def test_secure_mode_histogram_uses_the_csprng(yelp, tmp_path):
    """secure_mode: ChaCha20 Gaussian noise of the calibrated σ, recorded in the ledger."""
    _, data = yelp
    res = _release(yelp, tmp_path, mechanism="gaussian", epsilon=1.0, domain=DOMAIN, secure_mode=True)
    assert res.ledger.noise_source.startswith("csprng: ChaCha20")
    exact = Counter(read_split(data.train)[0])
    top = exact.most_common(1)[0][0]
    assert abs(_released(res)[top] - exact[top]) < 6 * res.ledger.noise_multiplier
    geo = _release(yelp, tmp_path / "geo", mechanism="geometric", epsilon=0.5, domain=DOMAIN, secure_mode=True)
    assert all(float(v).is_integer() for v in _released(geo).values())


def test_the_test_hook_fixes_the_noise_and_says_so(yelp, tmp_path, monkeypatch):
    """DPDISTILL_TEST_NOISE_SEED makes releases identical, and their ledger entry says NOT private."""
    monkeypatch.setenv(TEST_SEED_ENV, "3")
    a = _release(yelp, tmp_path / "a", mechanism="gaussian", epsilon=1.0, domain=DOMAIN)
    b = _release(yelp, tmp_path / "b", mechanism="gaussian", epsilon=1.0, domain=DOMAIN)
    assert _released(a) == _released(b)
    assert a.ledger.noise_source.startswith("TEST HOOK") and "NOT private" in a.ledger.noise_source


@pytest.mark.parametrize("secure", [False, True])
def test_two_sided_geometric_noise_has_the_laplace_like_law(secure):
    """P(k) ∝ exp(-ε|k|): P(0) = (1 - e^-ε) / (1 + e^-ε) and the law is symmetric, from
    either secret generator (inverse CDF of their uniforms)."""
    import math

    from pipeline.privacy import noise
    from pipeline.privacy.control_codes import _two_sided_geometric

    eps, n = 0.5, 200_000
    k = _two_sided_geometric(eps, n, noise.generator("control_codes", secure=secure))
    p0 = (1 - math.exp(-eps)) / (1 + math.exp(-eps))
    assert abs((k == 0).mean() - p0) < 5 * math.sqrt(p0 * (1 - p0) / n)
    assert abs((k == 1).mean() - (k == -1).mean()) < 6 * math.sqrt(2 * (k == 1).mean() / n)  # six standard errors
    assert abs((k == 1).mean() / (k == 0).mean() - math.exp(-eps)) < 0.02


@pytest.mark.parametrize("secure", [False, True])
def test_the_geometric_tail_is_not_cut_where_float32_uniforms_cut_it(secure, monkeypatch):
    """The attack on a truncated tail: with float32 uniforms (torch's default) the inverse CDF
    never gave a geometric above floor(24·ln 2 / ε) + 1 = 34 at ε = 0.5, so a noisy count 34
    above the truth was impossible for one neighbour and possible for the other (infinite
    privacy loss, about 10⁻⁸ a cell). The uniforms now carry 53 bits (multiples of 2⁻⁵³, some
    not of 2⁻²⁴), and the smallest one they can give reaches floor(53·ln 2 / ε) + 1 = 74."""
    import math

    from pipeline.privacy import control_codes, noise

    u = noise.uniform(noise.generator("control_codes", secure=secure), 4000)
    assert u.dtype == torch.float64 and 0 <= u.min() and u.max() < 1
    grid53 = u * 2.0**53 - (0.5 if secure else 0.0)  # ChaCha's are centred in their 2⁻⁵³ cells
    assert torch.equal(grid53, grid53.round())
    assert (u * 2.0**24 != (u * 2.0**24).round()).float().mean() > 0.99
    eps = 0.5
    largest = torch.tensor([1.0 - 2.0**-53, 0.0], dtype=torch.float64)  # u = 2⁻⁵³ and u = 1
    monkeypatch.setattr(noise, "uniform", lambda gen, n: largest)
    assert control_codes._two_sided_geometric(eps, 1, None).tolist() == [math.floor(53 * math.log(2) / eps)]
    assert math.floor(53 * math.log(2) / eps) + 1 == 74 > math.floor(24 * math.log(2) / eps) + 1 == 34
