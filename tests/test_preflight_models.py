"""The models a run names are checked before any stage runs (issue 35 item 2): every family of
the matrix passes in the default settings (bk clipping, the fast engine), and a model a stage
could not run is refused by `dpdistill run` and `plan` in one line naming the field, the model
and the fix, before the data stage and without a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
import yaml

from conftest import tiny_pipeline_dict
from families import FAMILIES
from flows.cli import main
from pipeline.config import config_from_dict
from pipeline.models.base import train_tokenizer
from pipeline.preflight_models import model_problems

PAIRS = ("llama", "qwen2", "gpt_neox", "gemma", "opt", "phi3")


@pytest.fixture(scope="module")
def model_dirs(tiny_tokenizer, tmp_path_factory) -> dict[str, Path]:
    """A saved tiny model per family (one is enough for teacher and student), with the tokenizer."""
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    for name in PAIRS:
        dirs[name] = root / name
        FAMILIES[name](len(tiny_tokenizer), tiny_tokenizer.eos_token_id).save_pretrained(dirs[name])
        tiny_tokenizer.save_pretrained(dirs[name])
    t5 = transformers.T5Config(vocab_size=len(tiny_tokenizer), d_model=32, d_ff=64, num_layers=1, num_heads=2)
    transformers.T5ForConditionalGeneration(t5).save_pretrained(root / "t5")
    tiny_tokenizer.save_pretrained(root / "t5")
    dirs["t5"] = root / "t5"
    other = train_tokenizer(["another corpus, another vocabulary entirely"] * 50, vocab_size=270)
    dirs["other-tokenizer"] = root / "other"
    FAMILIES["llama"](len(other), other.eos_token_id).save_pretrained(dirs["other-tokenizer"])
    other.save_pretrained(dirs["other-tokenizer"])
    return dirs


def _cfg(tmp_path: Path, teacher: Path, student: Path, **teacher_fields):
    tree = tiny_pipeline_dict(tmp_path)
    tree["teacher"].update(model=str(teacher), **teacher_fields)
    tree["distill"].update(student_model=str(student))
    return tree


@pytest.mark.parametrize("family", PAIRS)
def test_every_family_passes_in_the_default_settings(tmp_path, model_dirs, family):
    tree = _cfg(tmp_path, model_dirs[family], model_dirs[family])
    cfg = config_from_dict(tree)
    assert (cfg.teacher.grad_sample_mode, cfg.generate.engine) == ("bk", "fast")  # the defaults
    assert model_problems(cfg) == []
    for method in ("dp_sgd", "dpkd"):  # the student trains with DP-SGD too
        assert model_problems(config_from_dict({**tree, "distill": {**tree["distill"], "method": method}})) == []


def test_what_no_stage_can_run_is_named_with_its_fix(tmp_path, model_dirs):
    llama = model_dirs["llama"]
    bitfit = model_problems(config_from_dict(_cfg(tmp_path, llama, llama, mode="bitfit")))
    assert len(bitfit) == 1 and "teacher.mode=bitfit" in bitfit[0] and "llama model has none" in bitfit[0]
    assert model_problems(config_from_dict(_cfg(tmp_path, llama, llama, mode="lora"))) == []
    lora = model_problems(config_from_dict(_cfg(tmp_path, llama, llama, mode="lora", lora_target_modules=["nope"])))
    assert len(lora) == 1 and "teacher.mode=lora" in lora[0] and "set teacher.lora_target_modules" in lora[0], lora
    t5 = model_problems(config_from_dict(_cfg(tmp_path, model_dirs["t5"], model_dirs["t5"])))
    assert any("'t5' model, not a causal language model" in p for p in t5), t5
    assert any("generate.engine=fast cannot decode" in p and "generate.engine=hf" in p for p in t5), t5
    ghost = model_problems(config_from_dict(_cfg(tmp_path, model_dirs["gemma"], model_dirs["gemma"],
                                                  grad_sample_mode="ghost")))
    assert len(ghost) == 1 and "model.embed_tokens (GemmaTextScaledWordEmbedding)" in ghost[0], ghost
    assert "use teacher.grad_sample_mode=bk" in ghost[0]
    opt = model_problems(config_from_dict(_cfg(tmp_path, model_dirs["opt"], model_dirs["opt"], grad_sample_mode="hooks")))
    assert len(opt) == 1 and "embed_positions (OPTLearnedPositionalEmbedding): its forward takes numbers" in opt[0], opt
    mixed = model_problems(config_from_dict(_cfg(tmp_path, llama, model_dirs["other-tokenizer"])))
    assert len(mixed) == 1 and "use different tokenizers" in mixed[0] and "distill.student_model" in mixed[0]


@pytest.mark.parametrize("command", ["run", "plan"])
def test_the_cli_refuses_before_the_data_stage_in_one_line(tmp_path, model_dirs, capsys, command):
    tree = _cfg(tmp_path, model_dirs["llama"], model_dirs["llama"], mode="bitfit")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tree))
    assert main([command, "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dpdistill: error: pre-flight check of the models failed") and "bitfit" in err[-1]
    assert sum("dpdistill: error:" in line for line in err) == 1 and not any("Traceback" in line for line in err)
    assert not Path(tree["run_root"]).exists()  # no run directory, no data split
