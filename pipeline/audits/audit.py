"""Audit what a run publishes for verbatim spans of its private records.

    dpdistill audit RUN_DIR [--span 10]

Every file of the run directory is read for what it holds, whatever its name or folder
(`pipeline/audits/contents.py`): Parquet and Arrow IPC files as every cell of every type and
their metadata; JSON and JSON Lines; CSV by column; numpy arrays; a torch file through
`torch.load(weights_only=True)` (never an arbitrary unpickle); safetensors' header and tensors;
gzip, bz2, xz, zip and tar, each member (and its name) again by content; anything else as text
(UTF-8, UTF-16/32, Latin-1), HTML unescaped. Numbers are read as token ids with the run's
tokenizer (every integer array, tensor, column or list long enough to hold a span,
`pipeline/audits/numbers.py`), and strings for what they hold encoded (base64, hex,
URL-encoded, quoted-printable, escapes). A file's texts are read in order as one text
(`pipeline/audits/pieces.py`): a record one word per string or row is found, so is one in BPE
token strings or with each word in its own HTML tag. The names of every file and folder are a
source of their own (`NAMES`): a file named with a span publishes it. Symlinks are followed
while they stay inside the run directory, and read under their own name (a link publishes what
it points to). Not read by design, and listed as such: the private split files the data stage
wrote (`data/train|validation|test.parquet`, known by the path and sha256 its manifest gives
them, so an edited split, a link to one or any other Parquet file under data/ is read) and their
token-id copies. Float tensors whose values are not integers (a weight file's numbers) hold no
text and are named in `not_scanned`. Texts are normalised to lowercase words (split on
anything but letters and digits, underscores included) and every window of `span` words is
hashed; a window whose hash is one of the private records' windows is a hit. The result names
files, counts and splits only: a matched span is never printed, logged, written or put in an
exception message, and a name that holds one is withheld.

The private records are every split the run had: training, validation and test (the
held-out splits are private records too, which the ledger's ε does not cover). They are the
run's split files while it still has them, else rebuilt from the source files its
`config.yaml` names, with the same code as the data stage (`prepare_data`, into a
temporary directory that is deleted afterwards), so the sets are exactly the run's.

No Prefect here: `flows/audit.py` adds the flow run's Prefect logs and artifacts as extra
documents (`extra=`), and names what of Prefect it could not read (`extra_unread=`).

The audit fails closed: it says clean only when everything the run publishes was read. What
could not be read is listed in `audit.json`'s `incomplete` (name -> why: a format or an
exception's type, never content) and the summary says "INCOMPLETE"; `dpdistill audit` then
exits 3, or 1 when a span was found anyway: a file or archive member that is damaged, a
pickle weights_only refuses, a numpy object array, zstd, binary of an unknown format (its
bytes are still searched), numbers that may be token ids without a tokenizer to decode them,
a symlink leaving the run directory or leading nowhere, a FIFO, socket or device, a folder
that cannot be listed, and any Prefect source that cannot be read, or a run whose flow run is
unknown (`flows/audit_prefect.py`).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.audits.contents import Notes, Unreadable, texts_in, texts_of
from pipeline.audits.pieces import WordStream, words
from pipeline.config import ConfigError, PipelineConfig, load_config
from pipeline.records import SPLIT_KEY, TOKENIZED_DIR, read_split, split_key
from pipeline.stages.data import prepare_data
from pipeline.manifest import MANIFEST, atomic_write_json, sha256_file

AUDIT = "audit.json"
DEFAULT_SPAN = 10
SPLITS = ("train", "validation", "test")
NAMES = "(file and folder names)"
"""The source that holds the names of everything the run directory holds: a name can hold a span."""


class AuditError(ValueError):
    """The run cannot be audited as asked; the message says why (never quoting a record)."""


def shingles(text: str, span: int) -> Iterator[int]:
    """The hash of every window of `span` consecutive words of `text`."""
    w = words(text)
    for i in range(len(w) - span + 1):
        yield hash(tuple(w[i : i + span]))


@dataclass
class RecordIndex:
    """Hashes of every `span`-word window of the private records, and which record has it.
    Records are numbered across the splits in order: train first, then validation, test."""

    span: int
    owner: dict[int, int]  # shingle hash -> number of the first record holding it
    splits: dict[str, int]  # split -> its number of records
    n_short: int  # records with fewer than `span` words: nothing of theirs can be matched
    source: str

    @classmethod
    def build(cls, records: dict[str, list[str]], span: int, source: str) -> "RecordIndex":
        owner: dict[int, int] = {}
        n = short = 0
        for split in SPLITS:
            for text in records.get(split, []):
                found = False
                for h in shingles(text or "", span):
                    owner.setdefault(h, n)
                    found = True
                short += not found
                n += 1
        splits = {split: len(records.get(split, [])) for split in SPLITS}
        return cls(span=span, owner=owner, splits=splits, n_short=short, source=source)

    def found_by_split(self, records: set[int]) -> dict[str, int]:
        counts, start = {}, 0
        for split, n in self.splits.items():
            counts[split] = sum(start <= i < start + n for i in records)
            start += n
        return counts


@dataclass
class FileScan:
    """One file's (or source's) texts read in order as one text (`WordStream`: adjacent
    strings and rows, markup stripped, token strings glued); `hits` counts distinct spans."""

    bytes: int = 0
    texts: int = 0  # the texts read from it (cells, strings, documents)
    text_bytes: int = 0
    spans: int = 0
    matched: set[int] = field(default_factory=set)  # the record windows found
    records: set[int] = field(default_factory=set)
    stream: WordStream | None = field(default=None, repr=False)

    @property
    def hits(self) -> int:
        return len(self.matched)

    def add(self, text: str, index: RecordIndex) -> None:
        self.text_bytes += len(text.encode("utf-8", "replace"))
        self.stream = self.stream or WordStream(index.span)
        self._check(self.stream.feed(text), index)

    def close(self, index: RecordIndex) -> None:
        if self.stream is not None:
            self._check(self.stream.close(), index)

    def _check(self, hashes: list[int], index: RecordIndex) -> None:
        self.spans += len(hashes)
        for h in hashes:
            if (i := index.owner.get(h)) is not None:
                self.matched.add(h)
                self.records.add(i)

    def summary(self) -> dict:
        return {"bytes": self.bytes, "spans": self.spans, "hits": self.hits, "records": len(self.records)}


# --- the private records ----------------------------------------------------------------


def _resolve(path: Path, run_dir: Path) -> Path:
    """A config path as the run saw it: relative to the working directory, else to the
    checkout holding the run (runs/<name>/ two levels below it)."""
    if path.is_absolute() or path.is_file():
        return path
    for base in (run_dir.parent.parent, run_dir.parent):
        if (base / path).is_file():
            return base / path
    return path


def split_files(run_dir: Path) -> dict[str, Path]:
    """The private split files the data stage wrote into `run_dir/data`, still there and
    unchanged: split -> path. Known by the path and sha256 the data manifest gives them, not
    by a glob, so that any other file under data/ (or a split edited since) is scanned."""
    manifest = Path(run_dir) / "data" / MANIFEST
    try:
        outputs = json.loads(manifest.read_text())["outputs"] if manifest.is_file() else {}
        items = [(name, manifest.parent / Path(item["path"]).name, item["sha256"]) for name, item in outputs.items()]
    except (ValueError, KeyError, TypeError):  # damaged: no file can be recognised as a split
        return {}
    return {name: path for name, path, sha in items if path.is_file() and sha256_file(path) == sha}


def tokenized_copies(run_dir: Path, files: dict[str, Path]) -> dict[Path, str]:
    """The token-id copies of the split `files` that the stages keep beside them
    (`data/tokenized/<split>-<key>/ids.arrow`, pipeline/tokenized.py), as private as the
    splits: path -> split. Each is known by where it is (its key binds the split's sha256 and
    a tokenizer of the run) and checked to hold exactly the split's ids under that tokenizer, so
    an edited copy, or any other file there, is read."""
    folder = Path(run_dir) / "data" / TOKENIZED_DIR
    present = set(folder.glob("*/*")) if folder.is_dir() else set()
    if not present or not files:
        return {}
    from pipeline.models.base import load_tokenizer
    from pipeline.tokenized import holds_split_ids, tokenized_path

    shas = {split: sha256_file(path) for split, path in files.items()}
    found: dict[Path, str] = {}
    for d in dict.fromkeys(d.resolve() for d in _tokenizer_dirs(run_dir) if (d / "tokenizer_config.json").is_file()):
        tokenizer = load_tokenizer(str(d))
        for split, path in files.items():
            ids = tokenized_path(path, tokenizer, shas[split])
            if ids in present and ids not in found and holds_split_ids(ids, path, tokenizer):
                found[ids] = split
    return found


def private_records(run_dir: Path, files: dict[str, Path] | None = None) -> tuple[dict[str, list[str]], str]:
    """The texts of the run's records, by split (train, validation, test), and where they
    were read from: the run's split `files` (default: `split_files`), else the splits
    rebuilt from its data source."""
    run_dir = Path(run_dir)
    files = split_files(run_dir) if files is None else files
    if set(SPLITS) <= files.keys():
        return {split: read_split(files[split])[1] for split in SPLITS}, "data/{train,validation,test}.parquet"
    cfg, data = _run_data_config(run_dir)
    with tempfile.TemporaryDirectory(prefix="dpdistill-audit-") as tmp:
        result = prepare_data(data, Path(tmp), cfg.control_codes.domain, _split_key(run_dir))
        records = {split: read_split(getattr(result, split))[1] for split in SPLITS}
    return records, f"data.path {str(cfg.data.path)!r} (splits rebuilt as the data stage made them)"


def _split_key(run_dir: Path) -> bytes:
    """The key that split the run's records: its run root's (the run directory's parent)."""
    key = split_key(run_dir.parent, create=False)
    if key is None:
        raise AuditError(f"{run_dir.parent / SPLIT_KEY} not found: the splits cannot be rebuilt as the run made "
                         "them (the key that chose its held-out records is gone); audit a run whose data/ "
                         "splits are still present")
    return key


def training_texts(run_dir: Path) -> tuple[list[str], str]:
    """The texts of the run's training records, and where they were read from."""
    records, source = private_records(run_dir)
    return records["train"], source


def _run_data_config(run_dir: Path):
    """The run's config and its data config with the source paths resolved and checked."""
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise AuditError(f"{config_path} not found: pass a run directory (it holds config.yaml)")
    try:
        cfg: PipelineConfig = load_config(config_path)
    except ConfigError as e:
        raise AuditError(f"{config_path} cannot be read as a config: {e}") from e
    data = cfg.data.model_copy(update={
        "path": _resolve(Path(cfg.data.path), run_dir),
        "test_path": _resolve(Path(cfg.data.test_path), run_dir) if cfg.data.test_path else None,
    })
    if not Path(data.path).is_file():
        raise AuditError(
            f"the run's data.path {str(cfg.data.path)!r} is not found (from {Path.cwd()} or beside "
            f"the run) and the run has no split files: run the audit from the directory the run was "
            "started in (a canary run's data copy is deleted when `audit --canaries` ends; its "
            "canaries.json holds the audit made before)"
        )
    for key, path in (("data", data.path), ("test_data", data.test_path)):
        expected = _source_sha(run_dir, key)
        if path and expected and sha256_file(Path(path)) != expected:
            raise AuditError(
                f"{path} changed since the run read it (its sha256 differs from the data "
                "manifest's): the private records cannot be rebuilt from it"
            )
    return cfg, data


def _source_sha(run_dir: Path, key: str) -> str | None:
    manifest = run_dir / "data" / MANIFEST
    if not manifest.is_file():
        return None
    return json.loads(manifest.read_text()).get("inputs", {}).get(key, {}).get("sha256")


# --- the published files ----------------------------------------------------------------


def published(run_dir: Path) -> Iterator[tuple[str, Path | None, str | None]]:
    """Every file of the run directory, in name order: (its name relative to the run directory,
    the path to read, None), (name, None, why it cannot be read), or, for a folder, before what
    it holds, (name, None, None). Symlinks are followed
    while they stay inside the run directory (a file or folder linked there is published
    under the link's name too, so it is read under that name: a link to data/ would publish
    the private splits); one that leaves the run directory or leads nowhere is not followed and
    named unread, as are sockets, FIFOs and devices, and folders that cannot be listed."""
    run_dir = Path(run_dir)
    root = run_dir.resolve()

    def walk(folder: Path, rel: str, ancestors: frozenset[Path]) -> Iterator[tuple[str, Path | None, str | None]]:
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as e:
            yield rel or ".", None, f"folder could not be listed ({type(e).__name__})"
            return
        for entry in entries:
            name, path = f"{rel}/{entry.name}" if rel else entry.name, Path(entry.path)
            real = Path(os.path.realpath(path))
            if entry.is_symlink() and not real.exists():
                yield name, None, "symlink to nothing: not read"
            elif entry.is_symlink() and not real.is_relative_to(root):
                yield name, None, "symlink to outside the run directory: not followed"
            elif real.is_dir():
                if real in ancestors:  # a link back up the tree: every file below is read already
                    continue
                yield name, None, None
                yield from walk(path, name, ancestors | {real})
            elif real.is_file():
                yield name, path, None
            else:
                yield name, None, "not a regular file (a FIFO, socket or device): not read"

    yield from walk(run_dir, "", frozenset({root}))


def _tokenizer_dirs(run_dir: Path) -> Iterator[Path]:
    """Where the run's tokenizer may be: its model directories, then the teacher its
    generation manifest names (a cached teacher lives in another run)."""
    yield run_dir / "teacher" / "model"
    yield run_dir / "student" / "model"
    manifest = run_dir / "synthetic" / MANIFEST
    if manifest.is_file():
        for key, item in json.loads(manifest.read_text()).get("inputs", {}).items():
            if key.startswith("teacher/"):  # teacher/<file>: the file's directory is the teacher's
                yield Path(item["path"]).parents[len(Path(key).parts) - 2]


class TokenDecoder:
    """Token ids to text with the run's tokenizer, loaded on the first call. A row is cut where
    an id is not one of its vocabulary (negative, as padding labels are, or too large), and
    each part of at least `min_ids` ids is decoded: fewer cannot hold a span."""

    def __init__(self, run_dir: Path, min_ids: int = DEFAULT_SPAN):
        self.run_dir, self._tok, self.min_ids = Path(run_dir), None, min_ids

    def __call__(self, rows: list[list[int]]) -> list[str]:
        if self._tok is None:
            from transformers import AutoTokenizer

            found = next((d for d in _tokenizer_dirs(self.run_dir) if (d / "tokenizer_config.json").is_file()), None)
            if found is None:
                raise Unreadable(
                    "token ids, and no tokenizer to decode them (teacher/model, student/model, or the teacher "
                    "synthetic/manifest.json names): audit the run that trained the teacher, or copy its "
                    "tokenizer files into teacher/model"
                )
            self._tok = AutoTokenizer.from_pretrained(str(found))
        vocab, parts = len(self._tok), []
        for ids in rows:
            arr = np.asarray(ids, dtype=np.int64)
            cuts = np.flatnonzero((arr < 0) | (arr >= vocab))
            for part in np.split(arr, cuts):
                part = part[1:] if len(part) and not 0 <= part[0] < vocab else part
                if len(part) >= self.min_ids:
                    parts.append(part.tolist())
        return self._tok.batch_decode(parts) if parts else []


@dataclass
class AuditResult:
    report: dict
    path: Path

    @property
    def leak(self) -> bool:
        return self.report["total_hits"] > 0

    @property
    def incomplete(self) -> bool:
        """Something the run publishes was not (or not wholly) read: the audit cannot say clean."""
        return bool(self.report["incomplete"])


def _scan(texts: Iterator[str], scan: "FileScan", notes: Notes, index: RecordIndex) -> None:
    """Add every text to `scan`; what could not be read goes to `notes`, by kind or exception type
    (an exception's message could quote the file)."""
    try:
        for text in texts:
            scan.texts += 1
            scan.add(text, index)
    except Unreadable as e:
        notes.cannot(str(e))
    except Exception as e:
        notes.cannot(f"could not be read ({type(e).__name__})")
    scan.close(index)


class _Withheld:
    """A name as the report may show it: one that holds a span of a private record (a file or
    folder named with it, or inside such a folder) is withheld, numbered, since the report
    never quotes a record."""

    def __init__(self, index: RecordIndex):
        self.index, self.names = index, {}

    def __call__(self, name: str) -> str:
        if name in self.names or any(h in self.index.owner for h in shingles(name, self.index.span)):
            return self.names.setdefault(name, f"(a name holding a private span, #{len(self.names) + 1})")
        return name


def _scan_files(run_dir: Path, index: RecordIndex, splits: dict[Path, str], decode: TokenDecoder
                ) -> tuple[dict[str, FileScan], dict[str, str], dict[str, str]]:
    """Scan every file of `run_dir` (`published`) by its content but the private `splits`
    (path -> why). Returns the scans, what was not read by design (the splits, tensors: name ->
    why), and what could not be read (INCOMPLETE: name -> why)."""
    scans: dict[str, FileScan] = {}
    not_scanned: dict[str, str] = {}
    incomplete: dict[str, str] = {}
    names, shown = FileScan(), _Withheld(index)
    for name, path, problem in published(run_dir):
        names.texts += 1
        names.add(name, index)  # a file or folder named with a span publishes it
        name = shown(name)
        if problem:
            incomplete[name] = problem
            continue
        if path is None:  # a folder: its name is all it holds besides its files
            continue
        if path in splits:  # by the path the stage wrote it at: a link to it is read
            not_scanned[name] = splits[path]
            continue
        notes, scan = Notes(), FileScan()
        try:
            scan.bytes = path.stat().st_size
        except OSError as e:
            notes.cannot(f"could not be read ({type(e).__name__})")
        else:
            _scan(texts_of(path, decode, notes), scan, notes, index)
        if notes.tensors:
            not_scanned[name] = (f"binary tensors ({', '.join(sorted(notes.tensors))}): numbers that are not integers, "
                                 "so no token ids; its other content is read")
        scans[name] = scan
        if notes.unread:
            incomplete[name] = "; ".join(notes.unread)
    names.close(index)
    names.bytes = names.text_bytes
    scans[NAMES] = names
    return scans, not_scanned, incomplete


def audit_run(
    run_dir: Path, span: int = DEFAULT_SPAN, extra: dict[str, list] | None = None,
    extra_note: str | None = None, extra_unread: dict[str, str] | None = None,
) -> AuditResult:
    """Scan what `run_dir` publishes (and the `extra` documents, e.g. Prefect logs and
    artifacts: strings or decoded JSON values) for `span`-word windows of its private records;
    write `run_dir/audit.json`. `extra_unread` names the extra sources that could not be read
    (source -> why): with any unread file they make the result INCOMPLETE."""
    if span < 1:
        raise AuditError(f"span={span}: use a positive number of words, e.g. 10")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise AuditError(f"{run_dir} is not a directory: pass a run directory")
    t0 = time.time()
    splits = split_files(run_dir)  # hashed once: the splits can be the largest files of the run
    records, source = private_records(run_dir, splits)
    index = RecordIndex.build(records, span, source)
    del records
    private = {path: "private split" for path in splits.values()}
    private |= {path: f"private split (the token ids of data/{split}.parquet)"
                for path, split in tokenized_copies(run_dir, splits).items()}
    decode = TokenDecoder(run_dir, min_ids=span)  # loaded once, if anything holds token ids
    scans, not_scanned, incomplete = _scan_files(run_dir, index, private, decode)
    for name, docs in (extra or {}).items():
        notes, scan = Notes(), FileScan()
        scans[name] = scan
        for doc in docs:
            _scan(texts_in(doc, decode, notes), scan, notes, index)
        scan.bytes = scan.text_bytes
        if notes.unread:
            incomplete[name] = "; ".join(notes.unread)
    incomplete |= extra_unread or {}
    leaked = set().union(*(s.records for s in scans.values())) if scans else set()
    report = {
        "run_dir": str(run_dir.resolve()),
        "span": span,
        "private_records": index.splits,
        "records_shorter_than_span": index.n_short,
        "records_source": index.source,
        "files_scanned": len(scans),
        "bytes_scanned": sum(s.bytes for s in scans.values()),
        "spans_checked": sum(s.spans for s in scans.values()),
        "total_hits": sum(s.hits for s in scans.values()),
        "private_records_found": index.found_by_split(leaked),
        "files_with_hits": sorted(name for name, s in scans.items() if s.hits),
        "files": {name: s.summary() for name, s in scans.items()},
        "not_scanned": not_scanned,
        "incomplete": dict(sorted(incomplete.items())),
        "extra_sources": extra_note or ("none" if not extra else ", ".join(extra)),
        "elapsed_seconds": round(time.time() - t0, 2),
    }
    out = run_dir / AUDIT
    atomic_write_json(out, report)
    return AuditResult(report=report, path=out)


def _by_split(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {split}" for split, n in counts.items())


def format_audit(report: dict) -> str:
    """A short summary: counts and file names only."""
    lines = [
        f"audit of {report['run_dir']}: {report['span']}-word spans of the private records "
        f"({_by_split(report['private_records'])}; {report['records_shorter_than_span']} shorter than the "
        f"span), read from {report['records_source']}",
        f"scanned {report['files_scanned']} files/sources, {report['bytes_scanned']:,} bytes, "
        f"{report['spans_checked']:,} spans in {report['elapsed_seconds']:.1f} s; "
        f"Prefect: {report['extra_sources']}",
    ]
    if report["total_hits"]:
        lines.append(f"LEAK: {report['total_hits']} span(s) of private records "
                     f"({_by_split(report['private_records_found'])}) found in:")
        lines += [f"  {name}: {report['files'][name]['hits']} span(s), {report['files'][name]['records']} record(s)"
                  for name in report["files_with_hits"]]
    if report["incomplete"]:
        lines.append(f"INCOMPLETE: {len(report['incomplete'])} source(s) the run publishes not (wholly) read:")
        lines += [f"  {name}: {why}" for name, why in report["incomplete"].items()]
    elif not report["total_hits"]:
        lines.append("clean: no private record span found, and everything the run publishes was read")
    return "\n".join(lines)
