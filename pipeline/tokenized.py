"""Tokenized splits on Arrow: each private split tokenized once per run, then memory-mapped.

The data path for large corpora (issue 11). A record's token ids are stored as Arrow
`list<int32>` (4 bytes a token) in a file written once and opened memory-mapped, as a
`datasets.Dataset`, by every stage that reads the split (teacher, DP student, evaluation),
where Python lists take ~40 bytes a token and a dense (N, max_length) int64 tensor 8 bytes a
slot. Batches are padded to their own longest record by `pad_collate`, never to `max_length`.

Why not `Dataset(table).map(...)`: it needs the split's texts in memory (the largest thing
in it, ~600 bytes a Yelp record) and briefly a second copy; the file is streamed from the
Parquet split a batch at a time instead, and the Rust tokenizer's own threads encode each
batch in parallel (no worker processes, nothing pickled). bench/data_scale.py measures it.

The ids are those of `pipeline.records.encode_record` (the prompt and the text tokenized apart,
then eos), untruncated: the teacher cuts them to its `max_length` when it reads a record,
evaluation windows the whole record. Beside them, each record's prompt length (`n_prompt`),
which the losses leave out under a prompt template (pipeline/prompts.py `masks_prompt`).

Private: the files hold the private records' tokens. They live in `<data dir>/tokenized/`
(directory 0700, files 0600), inside the run directory, never in the `datasets` cache under
~/.cache (every file name is given here), and are deleted with the
splits after evaluation (`pipeline.stages.data.delete_private_copies`).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import Dataset

from pipeline.manifest import sha256_file
from pipeline.prompts import HEADER, PromptFormat
from pipeline.records import TOKENIZED_DIR, parquet_batches

if TYPE_CHECKING:
    import datasets

COLUMN = "input_ids"
PROMPT_COLUMN = "n_prompt"  # each record's prompt tokens, the first of its ids
IDS_FILE = "ids.arrow"
FORMAT = 2  # 2: with PROMPT_COLUMN (in the file's key: a folder written before holds ids only)
# Records per tokenizer call: work enough for the Rust tokenizer's threads; its per-call
# Encodings (~70 bytes a token: strings, offsets, masks) stay ~20 MB.
BATCH = 1024


@functools.cache
def hf_datasets():
    """The `datasets` module, imported on first use (with pandas, about a second: `dpdistill plan`
    and the model builders never need it), with its cache off: nothing in the `datasets` cache
    under ~/.cache/huggingface/datasets, even from a later transform of these Datasets; files
    are written only where this module (or the caller) names them."""
    import datasets

    datasets.disable_caching()
    return datasets


def _features():
    ds = hf_datasets()
    return ds.Features({COLUMN: ds.Sequence(ds.Value("int32")), PROMPT_COLUMN: ds.Value("int32")})


def tokenizer_fingerprint(tokenizer) -> str:
    """What decides the ids: the fast tokenizer's full serialisation (vocabulary, merges,
    normalisation), or the vocabulary of a slow one, and the eos id."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"{type(tokenizer).__name__}:{tokenizer.eos_token_id}:{spec}".encode()).hexdigest()


def _encoder(tokenizer, prompt: PromptFormat = HEADER):
    """A batch function giving `encode_record`'s ids and each record's prompt length: the few
    distinct prompts are tokenized once per batch, the texts in one call to the (Rust) tokenizer."""
    eos = tokenizer.eos_token_id
    backend = getattr(tokenizer, "backend_tokenizer", None)
    backend = getattr(backend, "_tokenizer", backend)  # a tokenizers.implementations wrapper holds one
    fast = getattr(backend, "encode_batch_fast", None)

    def encode_texts(texts: list[str]) -> list[list[int]]:
        if fast is None:  # a slow (Python) tokenizer
            return tokenizer(texts, add_special_tokens=False)["input_ids"]
        # The same ids without character offsets, which nothing here needs: ~10x faster.
        return [e.ids for e in fast(texts, add_special_tokens=False)]

    def encode(batch: dict) -> dict:
        prefixes = {c: prompt.ids(tokenizer, c) for c in set(batch["control_code"])}
        texts = encode_texts(batch["text"])
        return {COLUMN: [prefixes[c] + t + [eos] for c, t in zip(batch["control_code"], texts)],
                PROMPT_COLUMN: [len(prefixes[c]) for c in batch["control_code"]]}

    return encode


def _write_ids(split_path: Path, tokenizer, out_file: Path, prompt: PromptFormat) -> None:
    """Stream the split through the tokenizer into an Arrow file, a batch at a time: memory
    holds one batch of texts, never the split (its texts are the largest thing in it)."""
    encode, schema = _encoder(tokenizer, prompt), _features().arrow_schema  # with the features `datasets` reads back
    fd = os.open(out_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f, pa.ipc.new_stream(f, schema) as writer:
        for batch in parquet_batches(split_path, columns=["control_code", "text"], batch_size=BATCH):
            encoded = encode(batch.to_pydict())
            writer.write_batch(pa.record_batch([pa.array(encoded[c], schema.field(c).type) for c in schema.names],
                                               schema=schema))


def tokenized_split(split_path: Path, tokenizer, prompt: PromptFormat = HEADER) -> datasets.Dataset:
    """The split's token ids (one `input_ids` row per record, in the split's order), memory-mapped.

    Tokenized on the first call for this split file and tokenizer (keyed by both hashes),
    reused by every later call of the run. Safe when two processes race (data-parallel
    ranks): each writes a private temporary directory and the first rename wins.
    """
    split_path = Path(split_path)
    root = split_path.parent / TOKENIZED_DIR
    root.mkdir(mode=0o700, exist_ok=True)
    os.chmod(root, 0o700)  # mkdir's mode does not apply to a directory that already existed
    final = tokenized_path(split_path, tokenizer, prompt=prompt).parent
    if not final.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=f".{split_path.stem}-", dir=root))  # 0700
        try:
            _write_ids(split_path, tokenizer, tmp / IDS_FILE, prompt)
            try:
                os.rename(tmp, final)
            except OSError:  # another process renamed its identical copy first
                if not final.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return hf_datasets().Dataset.from_file(str(final / IDS_FILE))  # memory-mapped, not read


def tokenized_path(split_path: Path, tokenizer, split_sha256: str | None = None,
                   prompt: PromptFormat = HEADER) -> Path:
    """Where `tokenized_split` keeps the split's ids under `tokenizer` and `prompt`, written or
    not: a folder keyed by the split file's sha256, the tokenizer's fingerprint and the prompt's."""
    split_path = Path(split_path)
    sha = split_sha256 or sha256_file(split_path)
    spec = f"{sha}:{tokenizer_fingerprint(tokenizer)}:{json.dumps(prompt.key(), sort_keys=True)}:{FORMAT}"
    key = hashlib.sha256(spec.encode()).hexdigest()[:16]
    return split_path.parent / TOKENIZED_DIR / f"{split_path.stem}-{key}" / IDS_FILE


def holds_split_ids(ids_file: Path, split_path: Path, tokenizer, prompt: PromptFormat = HEADER) -> bool:
    """Whether `ids_file` holds exactly the ids `tokenized_split` writes for the split under
    `tokenizer`, row for row (the audit's test that a file is a private copy, not a
    publication): the split is encoded again a batch at a time, nothing is held whole."""
    def rows(batches):
        for batch in batches:
            yield from batch.column(0).to_pylist()

    encode = _encoder(tokenizer, prompt)
    expected = (ids for batch in parquet_batches(split_path, columns=["control_code", "text"], batch_size=BATCH)
                for ids in encode(batch.to_pydict())[COLUMN])
    with pa.memory_map(str(ids_file)) as source:
        reader = pa.ipc.open_stream(source)
        if reader.schema.names != [COLUMN, PROMPT_COLUMN]:
            return False
        sentinel = object()
        for got, want in itertools.zip_longest(rows(reader), expected, fillvalue=sentinel):
            if got != want:
                return False
    return True


def token_column(ds: datasets.Dataset, column: str = COLUMN) -> pa.ChunkedArray:
    """The memory-mapped `input_ids` (or `n_prompt`) column of a tokenized split (no copy)."""
    assert ds._indices is None, "a select()ed Dataset: its rows are not the table's rows"
    return ds.data.table.column(column)


class TokenIds(Dataset):
    """Map-style dataset of (ids (L,) int64, length) read from an Arrow `list<int>` column,
    one record at a time; ids cut to `max_length` when given. Nothing is loaded up front:
    the column may be memory-mapped. `collate` pads a batch of its items with `pad_id`.
    With `prompts` (each record's prompt length), items are (ids, length, prompt length)."""

    def __init__(self, column: pa.ChunkedArray | pa.Array, max_length: int | None = None, pad_id: int = 0,
                 prompts: pa.ChunkedArray | None = None):
        self.column, self.prompts = column, prompts
        self.max_length = max_length
        self.collate = functools.partial(pad_collate, pad_id=pad_id)

    def __len__(self) -> int:
        return len(self.column)

    def __getitem__(self, i):
        ids = self.column[int(i)].values.to_numpy(zero_copy_only=False)[: self.max_length]
        item = torch.from_numpy(ids.astype(np.int64)), torch.tensor(len(ids))
        return item if self.prompts is None else (*item, torch.tensor(self.prompts[int(i)].as_py()))

    def lengths(self) -> np.ndarray:
        """Each item's length (cut to `max_length`), from the column's offsets: no ids read."""
        lengths = pc.list_value_length(self.column).to_numpy(zero_copy_only=False)
        return lengths if self.max_length is None else np.minimum(lengths, self.max_length)


class ListIds(Dataset):
    """(ids, length) of sequences held as Python lists (small sets: evaluation windows)."""

    def __init__(self, sequences: list[list[int]], pad_id: int = 0):
        self.sequences = sequences
        self.collate = functools.partial(pad_collate, pad_id=pad_id)

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i):
        return torch.tensor(self.sequences[i], dtype=torch.long), torch.tensor(len(self.sequences[i]))

    def lengths(self) -> np.ndarray:
        return np.array([len(s) for s in self.sequences], dtype=np.int64)


def pad_collate(items: list[tuple[torch.Tensor, ...]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-pad a batch to its own longest sequence: ids (B, L_batch), lengths (B,), and the
    prompt lengths (B,) of items that carry them.

    Rows longer than their length (already padded) are cut to it first. Opacus wraps this
    collate for Poisson sampling's empty batches (DPDataLoader: ids (0, L) from the first batch).
    """
    lengths = torch.stack([item[1] for item in items])  # (B,)
    ids = torch.full((len(items), int(lengths.max())), pad_id, dtype=torch.long)  # (B, L_batch)
    for row, (x, n, *_) in enumerate(items):
        ids[row, : int(n)] = x[: int(n)]
    if len(items[0]) == 3:
        return ids, lengths, torch.stack([item[2] for item in items])
    return ids, lengths
