"""Shared fixtures: tiny tokenizer and GPT-2s built in memory from public text, tiny configs.

Nothing here downloads anything. The "private" records are the shipped Yelp sample.
"""

from __future__ import annotations

import atexit
import copy
import csv
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

# make test's two workers share the cores: one torch thread each (stages read it through
# pipeline.devices.default_threads; subprocesses inherit it). With torch's default, two threads
# a worker on 2 cores, the suite took 10 min 38 s and 18.6 CPU minutes, against 8 min 46 s and
# 12.5 with one (2026-11-24, idle 2 cores, one run each). A value set outside wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The run roots' records keys (pipeline/privacy/budget.py key_dir) go to this session's own folder,
# never to the user's ~/.config/dpdistill/keys; subprocesses inherit it.
os.environ["DPDISTILL_KEY_DIR"] = tempfile.mkdtemp(prefix="dpdistill-test-keys-")
atexit.register(shutil.rmtree, os.environ["DPDISTILL_KEY_DIR"], ignore_errors=True)

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import flows  # noqa: F401  (sets PREFECT_LOGGING_EXTRA_LOGGERS before Prefect configures logging)
import prefect.main  # noqa: F401  Prefect configures logging when this loads, binding its console
# handler to the sys.stderr of that moment: loaded first inside a test that captures output
# (capsys), it would keep that test's stream, closed after it, and fail every later log record.
from pipeline.config import BaseModelsConfig, DataConfig, GenerateConfig, TinyModelSpec, config_from_dict
from pipeline.stages.data import prepare_data
from pipeline.stages.generate import generate_synthetic
from pipeline.models.base import read_public_corpus, tiny_gpt2, train_tokenizer

pytest_plugins = ["gguf_tiny"]  # the tiny GGUF and its wheel (tests/gguf_tiny.py), for tests/models/

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = ROOT / "data" / "public" / "wikitext-2-valid.txt"
YELP_TRAIN = ROOT / "data" / "yelp_sample" / "train.csv"
YELP_TEST = ROOT / "data" / "yelp_sample" / "test.csv"
YELP_DOMAIN = {  # the public list of control-code values of the Yelp data (see data/README.md)
    "label1": [
        f"Business Category: {c}"
        for c in ["Restaurants", "Bars", "Shopping", "Beauty & Spas", "Event Planning & Services",
                  "Hotels & Travel", "Arts & Entertainment", "Health & Medical", "Home & Garden", "Grocery"]
    ],
    "label2": [f"Review Stars: {s}.0" for s in range(1, 6)],
}

warnings.filterwarnings("ignore", message="Full backward hook is firing")
warnings.filterwarnings("ignore", message="Secure RNG turned off")


def yelp_by_users(out: Path, users: int = 30, records: int = 120) -> Path:
    """The first `records` Yelp training reviews attributed round-robin to `users` users, as a
    CSV with a user column `author` (user-level data without the airline corpus)."""
    with open(YELP_TRAIN, newline="") as f:
        rows = list(csv.reader(f))[1:records + 1]
    path = Path(out) / "users.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label1", "label2", "author"])
        w.writerows(r + [f"user{i % users}"] for i, r in enumerate(rows))
    return path


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """Byte-level BPE with 300 tokens, trained on 200k characters of public WikiText."""
    paras = read_public_corpus(BaseModelsConfig(corpus=PUBLIC, max_corpus_chars=200_000))
    return train_tokenizer(paras, vocab_size=300)


def make_tiny_model(tokenizer, n_layer=1, n_embd=32, n_head=2, context=64):
    spec = TinyModelSpec(n_layer=n_layer, n_embd=n_embd, n_head=n_head)
    return tiny_gpt2(spec, len(tokenizer), context, tokenizer.eos_token_id)


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_tokenizer, tmp_path_factory) -> Path:
    """A saved 1-layer GPT-2 (randomly initialised) with the tiny tokenizer."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_model")
    make_tiny_model(tiny_tokenizer).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def tiny_pipeline_dict(tmp_path: Path) -> dict:
    """A whole-pipeline config small enough to run end to end in well under a minute."""
    return {
        "name": "tiny",
        "seed": 0,
        "run_root": str(tmp_path / "runs"),
        "data": {
            "path": str(YELP_TRAIN),
            "test_path": str(YELP_TEST),
            "max_records": 120,
            "max_test_records": 20,
            "validation_fraction": 0.1,
        },
        "control_codes": {"mechanism": "gaussian", "epsilon": 1.0, "domain": YELP_DOMAIN},
        "base_models": {
            "corpus": str(PUBLIC),
            "cache_dir": str(tmp_path / "base_cache"),
            "max_corpus_chars": 100_000,
            "vocab_size": 400,
            "context_length": 96,
            "teacher": {"n_layer": 1, "n_embd": 32, "n_head": 2, "steps": 30, "batch_size": 8},
            "student": {"n_layer": 1, "n_embd": 16, "n_head": 2, "steps": 30, "batch_size": 8},
        },
        "teacher": {
            "target_epsilon": 8.0,
            "epochs": 1,
            "batch_size": 32,
            "physical_batch_size": 16,
            "max_length": 96,
            "learning_rate": 1e-3,
        },
        "generate": {"num_samples": 24, "batch_size": 12, "max_length": 80},
        "distill": {"epochs": 1, "batch_size": 8, "learning_rate": 1e-3, "selection_samples": 8},
        "evaluate": {"window": 96, "batch_size": 8},
    }


@pytest.fixture
def tiny_config(tmp_path):
    return config_from_dict(tiny_pipeline_dict(tmp_path))


def noise_free_dp_gradient(tokenizer, mode: str, max_grad_norm: float):
    """One σ = 0 DP step's gradient on a tiny untied GPT-2 and three short records.

    Returns (model whose .grad holds the DP gradient after Opacus' clipping and scaling by
    the batch size, an untouched copy of the initial model, the batch inputs, labels, lengths).
    """
    from pipeline.batching import TokenizedRecords, lm_batch
    from pipeline.privacy.bk import BookKeepingPrivacyEngine as PrivacyEngine  # Opacus' own for ghost and hooks
    from pipeline.records import encode_record
    from pipeline.models.base import untie_lm_head
    from pipeline.models.losses import per_sequence_loss

    model = make_tiny_model(tokenizer)
    untie_lm_head(model)
    initial = copy.deepcopy(model)
    texts = ["Great tacos and friendly staff.", "Never again.", "The room was clean but the bed was hard."]
    data = TokenizedRecords([encode_record(tokenizer, "Stars: 5", t, 40) for t in texts], tokenizer.pad_token_id, 40)
    loader = torch.utils.data.DataLoader(data, batch_size=len(texts))
    ids, lengths = next(iter(loader))
    batch = lm_batch(ids, lengths)
    labels = batch.pop("labels")
    kwargs = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), data_loader=loader,
                  noise_multiplier=0.0, max_grad_norm=max_grad_norm, poisson_sampling=False, grad_sample_mode=mode)
    if mode == "ghost":
        dp_model, optimizer, criterion, _ = PrivacyEngine().make_private(criterion=torch.nn.CrossEntropyLoss(), **kwargs)
        shifted = dp_model(**batch).logits[:, :-1]
        loss = criterion(shifted.reshape(-1, shifted.shape[-1]), labels.reshape(-1), shape=shifted.shape)
        loss.backward()
    elif mode == "bk":
        dp_model, optimizer, _ = PrivacyEngine().make_private(**kwargs)
        dp_model.backward_clipped(per_sequence_loss(dp_model(**batch).logits, labels))
    else:
        dp_model, optimizer, _ = PrivacyEngine().make_private(**kwargs)
        per_sequence_loss(dp_model(**batch).logits, labels).mean().backward()
    optimizer.pre_step()  # clip, accumulate, add (zero) noise, scale by the expected batch size
    return model, initial, batch, labels, lengths


@pytest.fixture(scope="session")
def prefect_server():
    """One ephemeral Prefect server (SQLite) for the whole session: it takes ~10 s to start on an
    idle machine, and more than 120 s beside two one-thread studies on two cores, so it may take
    300. Yields its API URL, for flows run in a subprocess."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=300):
        yield PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def migrated_prefect_db(request, tmp_path_factory) -> Path:
    """A Prefect SQLite database with every migration applied, made once per Prefect version and
    kept in pytest's cache between sessions (per session without the cache plugin). A server
    started on an empty PREFECT_HOME runs every migration first: 8.5 s to healthy against 4 s on a
    copy of this, at load 3.5 on 2 cores (`prefect_home`)."""
    import prefect

    name = f"prefect-db-{prefect.__version__}"
    cache = getattr(request.config, "cache", None)
    where = cache.mkdir(name) if cache is not None else tmp_path_factory.mktemp(name)
    db = where / "prefect.db"
    if not db.is_file():
        build = Path(tempfile.mkdtemp(dir=where))
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {"PREFECT_HOME": str(build)}
        subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], env=env,
                       check=True, capture_output=True, timeout=600)
        os.replace(build / "prefect.db", db)  # whole or not at all: a second worker may be making its own
        shutil.rmtree(build, ignore_errors=True)
    return db


@pytest.fixture
def prefect_home(tmp_path, migrated_prefect_db) -> Path:
    """A new PREFECT_HOME (`tmp_path/prefect_home`) holding a copy of the migrated database, for a
    test that starts a Prefect server of its own: its server, its database, no migrations to wait for."""
    home = tmp_path / "prefect_home"
    home.mkdir()
    shutil.copyfile(migrated_prefect_db, home / "prefect.db")
    return home


def make_synthetic(teacher_dir: Path, out: Path, num_samples: int):
    """`num_samples` samples of a tiny teacher prompted by two control codes (3:1), in `out`."""
    codes = out / "codes.json"
    codes.write_text(json.dumps({"counts": {"Category: A": 3, "Category: B": 1}}))
    cfg = GenerateConfig(num_samples=num_samples, batch_size=num_samples // 2, max_length=32, validation_fraction=0.2)
    return generate_synthetic(cfg, teacher_dir=teacher_dir, control_codes_path=codes, ledger=[],
                              out_dir=out / "synthetic", seed=0)


@pytest.fixture(scope="module")
def synthetic(tiny_model_dir, tmp_path_factory):
    """40 samples of the tiny teacher (two control codes), for the distillation and selection tests."""
    return make_synthetic(tiny_model_dir, tmp_path_factory.mktemp("syn"), 40)


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    """Small private train/validation/test splits of the Yelp sample, for teacher tests."""
    out = tmp_path_factory.mktemp("data")
    cfg = DataConfig(
        path=YELP_TRAIN, test_path=YELP_TEST, max_records=110, max_test_records=10, validation_fraction=0.1
    )
    return prepare_data(cfg, out)


SHORT_CODE = "Business Category: Bars\tReview Stars: 5.0"  # 36 tokens of the tiny tokenizer's 48-token cut


def first_record_rewritten(split: Path, out: Path, text: str) -> Path:
    """`split` with its first record's text replaced, written to `out`. The record also gets a
    short control code: with the tiny tokenizer a prefix takes 36-52 tokens, so under the tests'
    max_length=48 a randomly split first record's text could be cut away entirely (the run's
    split key is secret, hence the split random) and the rewrite would change nothing."""
    table = pq.read_table(split)
    for column, value in (("text", text), ("control_code", SHORT_CODE)):
        values = table[column].to_pylist()
        values[0] = value
        table = table.set_column(table.schema.get_field_index(column), column, pa.array(values))
    pq.write_table(table, out)
    return out
