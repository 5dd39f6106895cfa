"""The builtin base models: built from a public corpus (a directory of documents, some held
out), exported as the shipped pair is stored, and the shipped pair itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pipeline.models import base as models
from pipeline.config import BaseModelsConfig, ConfigError, load_config
from pipeline.manifest import MANIFEST
from pipeline.models.base import (
    SHIPPED, build_base_models, export_base_models, fused_gelu, load_causal_lm, load_tokenizer, public_corpus,
    same_tokenizer,
)
from pipeline.models.pretrain import non_embedding_parameters
from pipeline.preflight import PreflightError, require_inputs
from tests.conftest import PUBLIC, tiny_pipeline_dict

TINY = {"vocab_size": 300, "context_length": 32,
        "teacher": {"n_layer": 1, "n_embd": 32, "n_head": 2, "steps": 4, "batch_size": 4},
        "student": {"n_layer": 1, "n_embd": 16, "n_head": 2, "steps": 4, "batch_size": 4}}


def _novels(tmp_path: Path, n: int = 5) -> Path:
    """A corpus directory of `n` public 'documents' cut from WikiText, one per file."""
    paras = [p for p in PUBLIC.read_text().split("\n \n") if p.strip() and not p.strip().startswith("=")]
    corpus = tmp_path / "novels"
    corpus.mkdir()
    for i in range(n):
        (corpus / f"doc{i}.txt").write_text("\n\n".join(paras[i * 40 : (i + 1) * 40]))
    (corpus / "README.md").write_text("not a document: only *.txt files are read")
    return corpus


def test_a_corpus_directory_holds_out_whole_documents(tmp_path):
    corpus = _novels(tmp_path)
    train, valid = public_corpus(BaseModelsConfig(corpus=corpus, validation_documents=2))
    held = models.held_out_documents(sorted(corpus.glob("*.txt")), 2)
    assert [d.name for d in held] == ["doc1.txt", "doc3.txt"]  # spread over the list, not the last ones
    held_paras = [p for d in held for p in models._paragraphs(d.read_text())]
    assert valid == held_paras and not set(valid) & set(train)
    assert len(train) + len(valid) == sum(len(models._paragraphs(d.read_text())) for d in corpus.glob("*.txt"))
    # a single file has no held-out part; never all documents are held out
    assert public_corpus(BaseModelsConfig(corpus=corpus / "doc0.txt"))[1] == []
    assert models.held_out_documents([corpus / "doc0.txt", corpus / "doc1.txt"], 5) == [corpus / "doc1.txt"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One tiny pair built from a corpus directory (one document held out), for the tests below."""
    tmp = tmp_path_factory.mktemp("built")
    return build_base_models(BaseModelsConfig(corpus=_novels(tmp), validation_documents=1,
                                              cache_dir=tmp / "cache", **TINY))


def test_build_records_tokens_and_validation_perplexity_and_exports_fp16(built, tmp_path):
    base = built
    info = json.loads((Path(base.teacher).parent / MANIFEST).read_text())
    teacher = info["models"]["teacher"]
    assert teacher["tokens_seen"] == 4 * 4 * 32
    assert 1 < teacher["validation_perplexity"] < 10 * 300  # scored on the held-out document
    assert info["corpus"]["validation_documents"] == ["doc2.txt"]

    out = export_base_models(base, tmp_path / "export")
    for name in ("teacher", "student"):
        with safe_open(str(out / name / "model.safetensors"), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    exported = load_causal_lm(str(out / "teacher"))  # fp16 on disk, fp32 for training
    assert next(exported.parameters()).dtype == torch.float32
    assert same_tokenizer(load_tokenizer(str(out / "student")), load_tokenizer(base.student))
    assert json.loads((out / "build.json").read_text())["models"]["student"]["tokens_seen"] == 4 * 4 * 32


def test_no_corpus_installs_the_shipped_pair_into_the_cache(built, tmp_path, monkeypatch):
    shipped = export_base_models(built, tmp_path / "shipped")
    monkeypatch.setattr(models, "SHIPPED", shipped)
    base = build_base_models(BaseModelsConfig(cache_dir=tmp_path / "c2"))
    assert Path(base.teacher).parent.name.startswith("shipped-")
    assert (Path(base.teacher).parent / MANIFEST).is_file()
    assert load_causal_lm(base.student).config.n_embd == 16


def test_the_shipped_pair(tmp_path):
    """What the package promises: a teacher at least 4x the student's non-embedding parameters
    and clearly better on held-out public text, one tokenizer, fp16, at most 20 MB."""
    size = sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file())
    assert size <= 20 * 2**20, f"{size / 2**20:.1f} MB"
    info = json.loads((SHIPPED / "build.json").read_text())
    teacher, student = (load_causal_lm(str(SHIPPED / n)) for n in ("teacher", "student"))
    assert non_embedding_parameters(teacher) >= 4 * non_embedding_parameters(student)
    figures = info["models"]
    assert figures["teacher"]["validation_perplexity"] < 0.8 * figures["student"]["validation_perplexity"]
    assert info["corpus"]["validation_documents"] and info["weights"] == "float16"
    assert same_tokenizer(load_tokenizer(str(SHIPPED / "teacher")), load_tokenizer(str(SHIPPED / "student")))
    assert "ELTeC" in (SHIPPED / "README.md").read_text()  # the attribution travels with them


def test_loaded_models_run_the_fused_gelu_and_save_gelu_new(tmp_path):
    """The shipped teacher as loaded computes GPT-2's tanh GELU with torch's fused kernel: the same
    logits as transformers' own `gelu_new` modules up to float rounding, and a saved copy still
    says gelu_new (a checkpoint anyone can load as GPT-2)."""
    from transformers import AutoModelForCausalLM
    from transformers.activations import GELUTanh, NewGELUActivation

    fused = load_causal_lm(str(SHIPPED / "teacher"))
    plain = AutoModelForCausalLM.from_pretrained(str(SHIPPED / "teacher"), dtype=torch.float32)
    kinds = lambda m: {type(x) for x in m.modules()} & {GELUTanh, NewGELUActivation}
    assert kinds(fused) == {GELUTanh} and kinds(plain) == {NewGELUActivation}
    ids = torch.randint(0, fused.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = fused(input_ids=ids).logits, plain(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=0)
    fused.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["activation_function"] == "gelu_new"
    assert kinds(fused_gelu(plain)) == {GELUTanh}


def test_shapes_without_a_corpus_are_refused(tmp_path):
    cfg = tiny_pipeline_dict(tmp_path)
    cfg["base_models"] = {"teacher": {"n_layer": 8}}
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="base_models.teacher differs from the shipped builtin pair.s but base_models.corpus is not set"):
        load_config(path)


def test_preflight_names_a_corpus_directory_without_documents(tmp_path):
    cfg = tiny_pipeline_dict(tmp_path)
    (tmp_path / "empty").mkdir()
    cfg["base_models"]["corpus"] = str(tmp_path / "empty")
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(cfg))
    with pytest.raises(PreflightError, match="holds no \\*.txt files"):
        require_inputs(load_config(path))
