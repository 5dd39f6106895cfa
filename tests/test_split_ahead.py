"""The data stage's split made ahead for the run's plan, and moved into the run (issue 61)."""

from __future__ import annotations

import json
import os

import pytest

from conftest import YELP_DOMAIN, YELP_TEST, YELP_TRAIN
from pipeline.config import DataConfig
from pipeline.manifest import manifest_problems
from pipeline.records import read_split, split_key
from pipeline.split_ahead import MADE, adopt, input_hashes, split_ahead
from pipeline.stages.data import DELETED, planned_split, prepare_data


def _cfg(**changes) -> DataConfig:
    return DataConfig(path=YELP_TRAIN, test_path=YELP_TEST, max_records=120, max_test_records=20, **changes)


def test_the_split_made_ahead_is_the_data_stage_s_and_moves_into_the_run(tmp_path):
    """The same split the data stage writes (the run root's key), read for the plan as
    `planned_split` reads it, moved into the stage's directory with its manifest (no second
    split); the private directory is gone when the `with` ends."""
    cfg, root = _cfg(), tmp_path / "root"
    sources = input_hashes(cfg)
    with split_ahead(cfg, root, YELP_DOMAIN, sources) as ahead:
        assert ahead.path.parent == root / ".cache" and ahead.path.stat().st_mode & 0o777 == 0o700
        assert ahead.planned == planned_split(cfg, root, YELP_DOMAIN)  # the key is the root's now
        out = tmp_path / "run" / "data"
        out.mkdir(parents=True)
        (out / DELETED).write_text("{}")  # an earlier run's record of deleted splits: stale once they are back
        result = adopt(ahead.path, out, cfg, YELP_DOMAIN, sources, split_key(root))
        assert result is not None and adopt(ahead.path, out, cfg, YELP_DOMAIN, sources, split_key(root)) is None
    assert not ahead.path.exists() and not list((root / ".cache").iterdir())
    own = prepare_data(cfg, tmp_path / "own", YELP_DOMAIN, split_key(root))
    assert (result.n_train, result.n_validation, result.n_test) == (own.n_train, own.n_validation, own.n_test)
    for split in ("train", "validation", "test"):
        path = getattr(result, split)
        assert path == out / f"{split}.parquet" and read_split(path) == read_split(getattr(own, split))
    assert manifest_problems(out) == [] and not (out / DELETED).exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["n_train"] == own.n_train and all(str(out) in o["path"] for o in manifest["outputs"].values())


@pytest.mark.parametrize("change", ["config", "domain", "inputs", "key"])
def test_a_split_made_from_anything_else_is_not_adopted(tmp_path, change):
    """Another data config, domain, input file (sha256) or split key: the data stage splits itself."""
    cfg, root = _cfg(), tmp_path / "root"
    sources = input_hashes(cfg)
    with split_ahead(cfg, root, YELP_DOMAIN, sources) as ahead:
        args = {"cfg": cfg, "code_domain": YELP_DOMAIN, "sources": sources, "key": split_key(root)}
        args |= {"config": {"cfg": _cfg(validation_fraction=0.2)}, "domain": {"code_domain": None},
                 "inputs": {"sources": sources | {"path": "0" * 64}}, "key": {"key": os.urandom(32)}}[change]
        assert adopt(ahead.path, tmp_path / "data", **args) is None
        assert (ahead.path / MADE).is_file() and not (tmp_path / "data").exists()
    # keep_private_copies changes nothing in the split
    with split_ahead(cfg, root, YELP_DOMAIN, sources) as ahead:
        assert adopt(ahead.path, tmp_path / "data", _cfg(keep_private_copies=True), YELP_DOMAIN, sources,
                     split_key(root)) is not None


def test_the_private_directory_is_deleted_on_an_error_and_after_a_kill(tmp_path):
    """An error inside the `with` deletes it; one a killed process left (its lock free) is
    deleted by the next split ahead under the root, and a live one is not."""
    cfg, root = _cfg(), tmp_path / "root"
    with pytest.raises(RuntimeError, match="stop"):
        with split_ahead(cfg, root, YELP_DOMAIN, input_hashes(cfg)) as ahead:
            raise RuntimeError("stop")
    assert not ahead.path.exists()
    abandoned = root / ".cache" / "split-ahead-0123456789abcdef"  # as a SIGKILLed run leaves it
    (abandoned / "data").mkdir(parents=True)
    (abandoned / "data" / "train.parquet").write_bytes(b"private")
    with split_ahead(cfg, root, YELP_DOMAIN, input_hashes(cfg)) as live:
        assert not abandoned.exists()
        with split_ahead(cfg, root, YELP_DOMAIN, input_hashes(cfg)) as other:  # a second run at once
            assert live.path.is_dir() and other.path != live.path
    assert list((root / ".cache").iterdir()) == []
