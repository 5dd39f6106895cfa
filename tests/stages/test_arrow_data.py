"""The data path on Arrow (issue 11): tokenized splits on disk, per-batch padding, lazy shards."""

from __future__ import annotations

import stat
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from opacus.data_loader import DPDataLoader
from torch.utils.data import DataLoader

from pipeline.config import DataConfig
from pipeline.records import TOKENIZED_DIR, encode_record, read_split
from pipeline.stages.data import delete_private_copies, prepare_data
from pipeline.stages.generate import read_synthetic, synthetic_head, synthetic_ids, synthetic_texts
from pipeline.stages.sampling import SCHEMA
from pipeline.privacy.dpsgd import OneRecordPerUser, Pick, RankShareSampler, shortest_first
from pipeline.tokenized import ListIds, TokenIds, pad_collate, token_column, tokenized_split
from tests.conftest import YELP_TEST, YELP_TRAIN


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")} if root.is_dir() else set()


@pytest.fixture
def data(tmp_path):
    cfg = DataConfig(path=YELP_TRAIN, test_path=YELP_TEST, max_records=60, max_test_records=8)
    return prepare_data(cfg, tmp_path / "run" / "data")


def test_split_is_tokenized_once_to_private_int32_arrow_in_the_run_dir(data, tiny_tokenizer):
    hf_cache = Path(datasets.config.HF_DATASETS_CACHE)
    before = _files(hf_cache)
    ds = tokenized_split(data.train, tiny_tokenizer)

    codes, texts = read_split(data.train)
    assert token_column(ds).to_pylist() == [encode_record(tiny_tokenizer, c, t) for c, t in zip(codes, texts)]
    root = data.train.parent / TOKENIZED_DIR
    (ids_file,) = [Path(f["filename"]) for f in ds.cache_files]  # memory-mapped from this file
    assert ids_file.is_relative_to(root) and isinstance(ds.data, datasets.table.MemoryMappedTable)
    with pa.memory_map(str(ids_file)) as f:
        assert pa.ipc.open_stream(f).schema.field("input_ids").type == pa.list_(pa.int32())
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*") if p.is_file()} == {0o600}
    assert _files(hf_cache) == before, "nothing may be written to the datasets cache under ~/.cache"

    again = tokenized_split(data.train, tiny_tokenizer)  # reused, not tokenized again
    assert [f["filename"] for f in again.cache_files] == [str(ids_file)]
    assert len(list(root.iterdir())) == 1

    deleted = delete_private_copies(data)
    assert root in deleted and not root.exists() and not data.train.exists()


def test_token_ids_are_cut_to_max_length_and_collate_pads_to_the_batch_longest(data, tiny_tokenizer):
    column = token_column(tokenized_split(data.train, tiny_tokenizer))
    full = TokenIds(column)
    cut = TokenIds(column, max_length=20, pad_id=tiny_tokenizer.pad_token_id)
    ids, length = cut[0]
    assert ids.dtype == torch.long and int(length) == 20 and ids.tolist() == column[0].as_py()[:20]
    assert int(full[0][1]) == len(column[0].as_py())

    short = ListIds([[5, 6, 7], [8, 9], [1, 2, 3, 4, 5]], pad_id=0)
    ids, lengths = short.collate([short[0], short[1]])
    assert ids.tolist() == [[5, 6, 7], [8, 9, 0]] and lengths.tolist() == [3, 2]  # width 3, not 5
    # an already padded row (an evaluation window) is cut to its length first
    ids, lengths = pad_collate([(torch.tensor([4, 4, 0, 0]), torch.tensor(2))], pad_id=7)
    assert ids.tolist() == [[4, 4]] and lengths.tolist() == [2]


def test_poisson_loader_pads_each_batch_and_keeps_opacus_empty_batches(data, tiny_tokenizer):
    """The teacher's loader (RankShareSampler + DPDataLoader's collate) over memory-mapped ids:
    batches are as wide as their longest record; an empty draw is a (0, L) batch."""
    records = TokenIds(token_column(tokenized_split(data.train, tiny_tokenizer)), 64, tiny_tokenizer.pad_token_id)
    dp_loader = DPDataLoader.from_data_loader(DataLoader(records, batch_size=8, collate_fn=records.collate))
    # rank 0 of 10 keeps only the draws it owns (~6 records), so many of its batches are empty
    share = RankShareSampler(num_samples=len(records), sample_rate=0.05, generator=torch.Generator().manual_seed(0),
                             rank=0, world_size=10)
    batches = list(DataLoader(records, batch_sampler=share, collate_fn=dp_loader.collate_fn))
    assert any(ids.shape[0] == 0 for ids, _ in batches) and any(ids.shape[0] > 0 for ids, _ in batches)
    for ids, lengths in batches:
        assert ids.dtype == torch.long and ids.dim() == 2
        if len(lengths):
            assert ids.shape[1] == int(lengths.max())


def test_physical_batches_of_a_poisson_batch_are_cut_in_length_order(data, tiny_tokenizer):
    """With the records' lengths, each step's draw is the same records, shortest first, so that
    BatchMemoryManager's physical batches pad less (and no record is lost or repeated)."""
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    records = TokenIds(token_column(tokenized_split(data.train, tiny_tokenizer)), 400, tiny_tokenizer.pad_token_id)
    lengths = records.lengths()  # reviews of 100 to over 1,000 byte-level tokens, cut at 400
    assert lengths.tolist() == [int(records[i][1]) for i in range(len(records))] and lengths.max() == 400 > lengths.min()

    def padded_and_draws(by_length: bool) -> tuple[int, list[list[int]]]:
        share = RankShareSampler(num_samples=len(records), sample_rate=0.5, generator=torch.Generator().manual_seed(3),
                                 arrange=shortest_first(lengths) if by_length else None)
        share.steps = 4
        draws = list(share)
        loader = DataLoader(records, batch_sampler=draws, collate_fn=records.collate)
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        optimizer.signal_skip_step = lambda do_skip: None  # BatchMemoryManager marks the last physical batch
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=optimizer) as physical:
            return sum(ids.numel() for ids, _ in physical), draws

    padded_random, unsorted = padded_and_draws(False)
    padded_sorted, by_length = padded_and_draws(True)
    assert [sorted(d) for d in by_length] == [sorted(d) for d in unsorted]  # the same Poisson draws
    assert all([lengths[i] for i in d] == sorted(lengths[i] for i in d) for d in by_length)
    assert padded_sorted < padded_random


def test_user_level_draws_pick_each_users_record_then_sort_the_picks_by_length(data, tiny_tokenizer):
    """User-level DP: each drawn user's one record is picked when the step is drawn, so that the
    physical batches can be cut from the picks in length order; the loader reads those records."""
    records = TokenIds(token_column(tokenized_split(data.train, tiny_tokenizer)), 400, tiny_tokenizer.pad_token_id)
    lengths = records.lengths()
    users = [f"user {i % 20:02d}" for i in range(len(records))]  # 20 users of 2-3 records each
    train = OneRecordPerUser(records, users, torch.Generator().manual_seed(5))
    share = RankShareSampler(num_samples=len(train), sample_rate=0.6, generator=torch.Generator().manual_seed(3),
                             arrange=shortest_first(lengths, train))
    for step in share:
        assert step and all(isinstance(p, Pick) and users[p.record] == f"user {p.user:02d}" for p in step)
        assert len({p.user for p in step}) == len(step)  # one record per drawn user
        assert [lengths[p.record] for p in step] == sorted(lengths[p.record] for p in step)
        ids, n = records.collate([train[p] for p in step])
        assert n.tolist() == [lengths[p.record] for p in step]
        assert ids[0, : n[0]].tolist() == records[step[0].record][0].tolist()


def _shard(path: Path, first: int, n: int, validation: set[int]) -> None:
    rows = [{"sample_id": first + i, "split": "validation" if first + i in validation else "train",
             "control_code": f"code {first + i}", "text": f"text {first + i}", "n_tokens": 3 + i,
             "n_prompt_tokens": 2, "token_ids": list(range(3 + i)), "finished": True} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path)


def test_synthetic_shards_are_read_lazily(tmp_path):
    synthetic = tmp_path / "synthetic"
    synthetic.mkdir()
    _shard(synthetic / "shard-00000.parquet", 0, 5, {3})
    _shard(synthetic / "shard-00001.parquet", 5, 5, {7})

    head = synthetic_head(synthetic, 3, "train")
    assert head["text"].to_pylist() == ["text 0", "text 1", "text 2"] and head.column_names == ["control_code", "text"]
    assert synthetic_texts(synthetic, 100) == [f"text {i}" for i in range(10)]

    train = synthetic_ids(synthetic, "train", tmp_path / "ids" / "train.arrow")
    expected = read_synthetic(synthetic, "train")
    assert isinstance(train.data, datasets.table.MemoryMappedTable)
    assert train["sample_id"] == expected["sample_id"].to_pylist() == [0, 1, 2, 4, 5, 6, 8, 9]
    assert train["token_ids"] == expected["token_ids"].to_pylist()
    assert synthetic_ids(synthetic, "validation", tmp_path / "ids" / "validation.arrow")["sample_id"] == [3, 7]


def test_perplexity_of_tokenized_ids_is_that_of_the_texts(data, tiny_tokenizer, tiny_model_dir):
    from pipeline.stages.evaluate import perplexity
    from pipeline.models.base import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir))
    codes, texts = read_split(data.test)
    ids = token_column(tokenized_split(data.test, tiny_tokenizer)).to_pylist()
    assert perplexity(model, tiny_tokenizer, codes, texts, 32, 4, token_ids=ids) == \
        perplexity(model, tiny_tokenizer, codes, texts, 32, 4)


def test_scores_batched_by_length_are_each_sequence_scored_alone(tiny_tokenizer, tiny_model_dir):
    """nll_by_owner batches sequences shortest first (less padding): every owner still gets the
    sum of its own sequences' NLL, as when each is scored on its own, unpadded."""
    from pipeline.models.base import load_causal_lm
    from pipeline.models.scoring import by_length, nll_by_owner

    model = load_causal_lm(str(tiny_model_dir))
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, len(tiny_tokenizer), (int(n),), generator=g).tolist()
                 for n in torch.randint(2, 60, (11,), generator=g)]
    data = ListIds(sequences, tiny_tokenizer.pad_token_id)
    batches = by_length(data, 4)
    assert sorted(i for b in batches for i in b) == list(range(11)) and [len(b) for b in batches] == [4, 4, 3]
    assert [len(sequences[i]) for b in batches for i in b] == sorted(map(len, sequences))
    owners = [i % 3 for i in range(11)]
    nll, count = nll_by_owner(model, data, owners, 3, batch_size=4)
    alone = [nll_by_owner(model, ListIds([s], 0), [0], 1, batch_size=1) for s in sequences]
    for owner in range(3):
        mine = [a for a, o in zip(alone, owners) if o == owner]
        assert count[owner] == sum(c[0] for _, c in mine)
        assert nll[owner] == pytest.approx(sum(n[0] for n, _ in mine), rel=1e-5)
