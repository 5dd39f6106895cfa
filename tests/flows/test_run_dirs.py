"""Run directories: private modes whatever the umask, and no writes (or deletes) outside them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from conftest import YELP_TEST, YELP_TRAIN, tiny_pipeline_dict

from flows.caching import RESULTS_DIR, deleted_after_evaluation
from flows.cli import main
from flows.run_dirs import checked_run_dir, new_run_dir, prepare_run_root
from flows.run_info import RUN_INFO, TOOL, RunDirError
from flows.tasks import _data_key
from pipeline.config import DataConfig, config_from_dict
from pipeline.records import split_key
from pipeline.stages.data import DataResult, delete_private_copies, prepare_data
from pipeline.manifest import atomic_write_json, manifest_problems


@pytest.fixture
def open_umask():
    old = os.umask(0)  # the worst case: every file would be created world-writable
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_run_root_cache_and_run_dirs_are_0700(tmp_path, open_umask):
    cfg = config_from_dict(tiny_pipeline_dict(tmp_path))
    root = prepare_run_root(cfg)
    run = new_run_dir(cfg)
    assert {p: _mode(p) for p in (root, root / ".cache", root / RESULTS_DIR, run)} == dict.fromkeys(
        (root, root / ".cache", root / RESULTS_DIR, run), 0o700)


def test_a_shared_run_root_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp
    cfg = config_from_dict(tiny_pipeline_dict(tmp_path) | {"run_root": str(shared)})
    with pytest.raises(RunDirError, match="shared or not yours"):
        prepare_run_root(cfg)
    assert shared.stat().st_mode & 0o7777 == 0o1777  # left as it was


@pytest.mark.parametrize("test_file", [{"test_path": YELP_TEST, "max_test_records": 10}, {}])
def test_private_splits_are_0600_and_can_be_deleted(tmp_path, open_umask, test_file):
    cfg = DataConfig(path=YELP_TRAIN, max_records=60, **test_file)
    key = split_key(tmp_path)  # the run root's: a rerun rewrites the same split
    result = prepare_data(cfg, tmp_path / "data", key=key)
    splits = (result.train, result.validation, result.test)
    assert [_mode(p) for p in splits] == [0o600] * 3
    assert not list((tmp_path / "data").glob(".*.tmp"))

    assert delete_private_copies(result) == list(splits)
    assert not any(p.exists() for p in splits)
    assert (tmp_path / "data" / "manifest.json").is_file()  # their hashes stay
    assert len(manifest_problems(tmp_path / "data")) == 3  # a cache hit on it is stale: the stage reruns
    # ... as the expected event of a rerun, said at INFO: exactly the splits recorded as deleted are missing
    assert deleted_after_evaluation(result)
    again = prepare_data(cfg, tmp_path / "data", key=key)
    assert manifest_problems(tmp_path / "data") == [] and isinstance(again, DataResult)
    assert not (tmp_path / "data" / "deleted.json").exists()  # the splits are back: no stale record

    # Anything else missing or changed keeps the warning: a split deleted by hand, not recorded ...
    Path(again.train).unlink()
    assert manifest_problems(tmp_path / "data") and not deleted_after_evaluation(again)
    # ... or recorded as deleted, while another split changed since its manifest
    again = prepare_data(cfg, tmp_path / "data", key=key)
    delete_private_copies(again)
    Path(again.test).write_bytes(b"not the split")
    assert not deleted_after_evaluation(again)


def test_test_split_is_in_the_data_key_only_where_it_changes_the_split(tmp_path):
    """data.test_split=keyed is the split made before the field existed (issue 60), and with a
    data.test_path the field changes nothing: out of the key, so run roots from before keep their
    cached stages. 'fixed' without a test file is another split: the stages run again."""
    cfg = config_from_dict(tiny_pipeline_dict(tmp_path))

    def data_key(**update):
        return _data_key(cfg.model_copy(update={"data": cfg.data.model_copy(update=update)}))

    assert "test_split" not in data_key(test_split="keyed", test_path=None)
    assert data_key(test_split="fixed", test_path=None)["test_split"] == "fixed"
    assert data_key(test_split="fixed", test_path=YELP_TEST) == data_key(test_split="keyed", test_path=YELP_TEST)


def test_keep_private_copies_defaults_to_false():
    assert DataConfig(path=YELP_TRAIN).keep_private_copies is False


def test_checked_run_dir(tmp_path):
    cfg = config_from_dict(tiny_pipeline_dict(tmp_path))
    root = prepare_run_root(cfg)
    for outside in (tmp_path / "elsewhere", root, root / ".." / "runs2", Path("/")):
        with pytest.raises(RunDirError, match="not inside run_root"):
            checked_run_dir(cfg, outside)
    assert checked_run_dir(cfg, root / "new") == root / "new"  # new
    (root / "empty").mkdir()
    assert checked_run_dir(cfg, root / "empty") == root / "empty"
    foreign = root / "foreign"
    (foreign / "teacher").mkdir(parents=True)
    with pytest.raises(RunDirError, match="holds no run.json written by dpdistill"):
        checked_run_dir(cfg, foreign)
    atomic_write_json(foreign / RUN_INFO, {"status": "completed"})  # a run.json, but not ours
    with pytest.raises(RunDirError, match="holds no run.json written by dpdistill"):
        checked_run_dir(cfg, foreign)
    atomic_write_json(foreign / RUN_INFO, {"tool": TOOL, "status": "failed"})
    assert checked_run_dir(cfg, foreign) == foreign
    link = root / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(RunDirError, match="not inside run_root"):
        checked_run_dir(cfg, link)


def test_cli_refuses_to_force_a_stage_outside_run_root(prefect_server, tmp_path, capsys):
    """`--force teacher --run-dir DIR` with DIR outside run_root (or not a dpdistill run
    directory) stops with one line and exit code 2, and deletes nothing."""
    tree = tiny_pipeline_dict(tmp_path)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tree))
    victims = [tmp_path / "home" / "project", Path(tree["run_root"]) / "not-a-run"]
    for victim in victims:
        (victim / "teacher").mkdir(parents=True)
        (victim / "teacher" / "precious.txt").write_text("keep me")
        code = main(["run", "--config", str(config), "--run-dir", str(victim), "--force", "teacher"])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("dpdistill: error: ") and err.count("\n") == 1, err
        assert (victim / "teacher" / "precious.txt").read_text() == "keep me"
        assert not (victim / RUN_INFO).exists()
