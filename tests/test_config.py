"""Config loading: YAML + dotted overrides, one ConfigError listing every problem."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError, config_from_dict, dump_config, load_config

from conftest import tiny_pipeline_dict

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def test_demo_config_loads_with_typed_overrides():
    """configs/demo.yaml loads; dotted overrides apply with the field's type."""
    base = load_config(DEMO)
    assert base.name == "demo"
    cfg = load_config(DEMO, ["teacher.target_epsilon=4", "generate.num_samples=10"])
    assert cfg.teacher.target_epsilon == 4.0 and isinstance(cfg.teacher.target_epsilon, float)
    assert cfg.generate.num_samples == 10 and isinstance(cfg.generate.num_samples, int)
    # untouched fields keep the file's values
    assert cfg.teacher.batch_size == base.teacher.batch_size == 128
    assert cfg.generate.batch_size == base.generate.batch_size


def test_unknown_key_is_named_with_fix():
    """An unknown key raises ConfigError naming the dotted key and telling to remove / check spelling."""
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, ["teacher.epsilon=3"])
    msg = str(err.value)
    assert "teacher.epsilon" in msg
    assert "remove it" in msg and "spelling" in msg


def test_all_problems_reported_in_one_error():
    """Several bad values are all listed in one ConfigError, each with its field and value."""
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, ["teacher.target_epsilon=-1", "distill.alpha=2"])
    msg = str(err.value)
    assert "2 problem" in msg
    assert "teacher.target_epsilon = -1" in msg
    assert "distill.alpha = 2" in msg


def test_physical_batch_larger_than_batch_is_refused(tmp_path):
    """physical_batch_size > batch_size is refused with a message naming both fields."""
    tree = tiny_pipeline_dict(tmp_path)
    tree["teacher"]["batch_size"] = 8
    tree["teacher"]["physical_batch_size"] = 16
    with pytest.raises(ConfigError) as err:
        config_from_dict(tree)
    msg = str(err.value)
    assert "teacher.physical_batch_size=16" in msg
    assert "teacher.batch_size=8" in msg


def test_override_without_equals_sign_is_refused():
    """An override that is not key=value raises ConfigError."""
    with pytest.raises(ConfigError, match="key=value"):
        load_config(DEMO, ["teacher.target_epsilon"])


def test_missing_file_names_the_path(tmp_path):
    """A missing config file raises ConfigError naming the path."""
    missing = tmp_path / "nope" / "absent.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(missing)
    assert str(missing) in str(err.value)


def test_dump_config_round_trips(tmp_path):
    """dump_config output, loaded back through config_from_dict, equals the original."""
    for cfg in (load_config(DEMO, ["seed=3"]), config_from_dict(tiny_pipeline_dict(tmp_path))):
        again = config_from_dict(yaml.safe_load(dump_config(cfg)))
        assert again == cfg


@pytest.mark.parametrize("path", sorted((DEMO.parent).glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path):
    """Each config in configs/ passes validation (the paper's setting included)."""
    cfg = load_config(path)
    assert cfg.teacher.target_epsilon > 0
