"""The models a run names are checked before any stage runs (issue 35 item 2): every family of
the matrix passes in the default settings (bk clipping, the fast engine), and a model a stage
could not run is refused by `dpdistill run` and `plan` in one line naming the field, the model
and the fix, before the data stage and without a traceback. A model a clipping mode cannot clip
exactly is refused in that mode, naming the layer and a mode that can, or none (issue 62 items
9-13; every family in every mode: tests/privacy/test_clipping_modes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
import yaml

from conftest import tiny_pipeline_dict
from families import CLIPPING_FAMILIES, ToyConfig, ToyLM
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
    for name in PAIRS + ("falcon",):
        dirs[name] = root / name
        CLIPPING_FAMILIES[name](len(tiny_tokenizer), tiny_tokenizer.eos_token_id).save_pretrained(dirs[name])
        tiny_tokenizer.save_pretrained(dirs[name])
    for kind in ("outside", "twice", "gate"):  # a user's own model code (tests/families.py ToyLM)
        dirs[kind] = root / kind
        ToyLM(ToyConfig(vocab_size=len(tiny_tokenizer), kind=kind)).save_pretrained(dirs[kind])
        tiny_tokenizer.save_pretrained(dirs[kind])
    t5 = transformers.T5Config(vocab_size=len(tiny_tokenizer), d_model=32, d_ff=64, num_layers=1, num_heads=2)
    transformers.T5ForConditionalGeneration(t5).save_pretrained(root / "t5")
    tiny_tokenizer.save_pretrained(root / "t5")
    dirs["t5"] = root / "t5"
    other = train_tokenizer(["another corpus, another vocabulary entirely"] * 50, vocab_size=270)
    dirs["other-tokenizer"] = root / "other"
    CLIPPING_FAMILIES["llama"](len(other), other.eos_token_id).save_pretrained(dirs["other-tokenizer"])
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


def _clipping(tmp_path, model_dirs, name: str, mode: str) -> list[str]:
    """What preflight says of the model `name` (teacher and student) in clipping mode `mode`."""
    tree = _cfg(tmp_path, model_dirs[name], model_dirs[name], grad_sample_mode=mode)
    tree["generate"]["engine"] = "hf"  # the fast engine decodes the families, not a user's own model
    return model_problems(config_from_dict(tree))


@pytest.mark.parametrize("mode", ["bk", "ghost", "hooks"])
def test_a_weight_also_used_outside_its_module_is_refused_in_every_mode(tmp_path, model_dirs, mode):
    """Items 9, 10: lin.weight also used through F.linear in the model's forward. bk passed
    preflight and failed in the teacher stage, after the data stages; ghost passed and clipped
    each example to more than C; hooks would drop that use's gradient. Refused in every mode,
    for teacher and student, naming the weight and saying that no mode can."""
    problems = _clipping(tmp_path, model_dirs, "outside", mode)
    assert [p.split(":")[0] for p in problems] == ["teacher.model " + repr(str(model_dirs["outside"]))], problems
    assert f"(teacher.grad_sample_mode={mode}) cannot train lin.weight: used outside its module, by the model " \
           "(ToyLM)" in problems[0]
    assert problems[0].endswith("no clipping mode can train it as it stands: change or freeze the layers named")


def test_a_linear_called_twice_is_refused_by_ghost_with_the_modes_that_can(tmp_path, model_dirs):
    """Item 13: Opacus refuses it at ghost's first step ("Parameter tying is not supported with
    Ghost Clipping"); bk and hooks clip it exactly."""
    assert _clipping(tmp_path, model_dirs, "twice", "bk") == _clipping(tmp_path, model_dirs, "twice", "hooks") == []
    ghost = _clipping(tmp_path, model_dirs, "twice", "ghost")
    assert len(ghost) == 1 and "cannot train lin (Linear): lin.weight (2 calls)" in ghost[0], ghost
    assert ghost[0].endswith("use teacher.grad_sample_mode=bk (or hooks)")


def test_a_one_element_gate_passes_every_mode(tmp_path, model_dirs):
    """Item 11: bk computed the gate's norms with the input's width and crashed assigning its
    sum; it now clips it exactly (tests/privacy/test_clipping_modes.py), as ghost and hooks do."""
    for mode in ("bk", "ghost", "hooks"):
        assert _clipping(tmp_path, model_dirs, "gate", mode) == [], mode


def test_falcon_trains_in_bk_and_is_refused_by_opacus_naming_the_layer(tmp_path, model_dirs):
    """Item 12: bk refused FalconLinear by its class; ghost and hooks passed preflight and failed in
    the teacher stage (Opacus' hooks return a layer's output as a view, and Falcon adds to its
    MLP's output in place). bk now clips it as the linear map it computes."""
    assert _clipping(tmp_path, model_dirs, "falcon", "bk") == []
    for mode in ("ghost", "hooks"):
        problems = _clipping(tmp_path, model_dirs, "falcon", mode)
        assert len(problems) == 1 and f"(teacher.grad_sample_mode={mode}) cannot train transformer.h.0.mlp." \
            "dense_4h_to_h (FalconLinear): its output is modified in place by transformer.h.0 (FalconDecoderLayer)" \
            in problems[0], problems
        assert problems[0].endswith("use teacher.grad_sample_mode=bk")


@pytest.mark.parametrize("command", ["run", "plan"])
@pytest.mark.parametrize("model", ["llama-bitfit", "outside"])
def test_the_cli_refuses_before_the_data_stage_in_one_line(tmp_path, model_dirs, capsys, command, model):
    """`outside`: item 10, refused where the teacher stage used to fail after the data stages."""
    if model == "outside":
        tree = _cfg(tmp_path, model_dirs["outside"], model_dirs["outside"])
        tree["generate"]["engine"] = "hf"
    else:
        tree = _cfg(tmp_path, model_dirs["llama"], model_dirs["llama"], mode="bitfit")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tree))
    assert main([command, "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dpdistill: error: pre-flight check of the models failed")
    assert ("bitfit" if model == "llama-bitfit" else "lin.weight: used outside its module") in err[-1]
    assert sum("dpdistill: error:" in line for line in err) == 1 and not any("Traceback" in line for line in err)
    assert not Path(tree["run_root"]).exists()  # no run directory, no data split
