"""Audit what a run publishes for verbatim spans of its private training records.

    dpdistill audit RUN_DIR [--span 10]

Every file of the run directory is scanned except the private splits (`data/*.parquet`),
checkpoints (`*/checkpoint/`) and model weights (binary tensors, listed as not scanned):
the synthetic shards' text, report.html, logs, JSON files, the model directories' config,
tokenizer and model card. Texts are normalised to lowercase words (split on non-word
characters) and every window of `span` words is hashed; a window whose hash is one of the
training records' windows is a hit. The result names files and counts only: a matched
span is never printed, logged, written or put in an exception message.

The training records are the run's own: `data/train.parquet` when the run still has its
split copies, else the split rebuilt from the source file its `config.yaml` names, with
the same code as the data stage (`prepare_data`, into a temporary directory that is
deleted afterwards), so the set is exactly the records the teacher trained on.

No Prefect here: `flows/audit.py` adds the flow run's Prefect logs and artifacts as extra
documents (`extra=`).
"""

from __future__ import annotations

import html
import json
import re
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import ConfigError, PipelineConfig, load_config
from pipeline.stages.data import prepare_data, read_split
from pipeline.manifest import MANIFEST, atomic_write_json, sha256_file

AUDIT = "audit.json"
DEFAULT_SPAN = 10
# Binary tensors: no text to find, and a large model's weights would dominate the scan.
WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".npy", ".npz"}
_WORD = re.compile(r"\w+")


class AuditError(ValueError):
    """The run cannot be audited as asked; the message says why (never quoting a record)."""


def words(text: str) -> list[str]:
    """Lowercase words, split on non-word characters: 'Great—tacos!' -> ['great', 'tacos']."""
    return _WORD.findall(text.lower())


def shingles(text: str, span: int) -> Iterator[int]:
    """The hash of every window of `span` consecutive words of `text`."""
    w = words(text)
    for i in range(len(w) - span + 1):
        yield hash(tuple(w[i : i + span]))


@dataclass
class TrainingIndex:
    """Hashes of every `span`-word window of the training records, and which record has it."""

    span: int
    owner: dict[int, int]  # shingle hash -> index of the first training record holding it
    n_records: int
    n_short: int  # records with fewer than `span` words: nothing of theirs can be matched
    source: str

    @classmethod
    def build(cls, texts: Iterable[str], span: int, source: str) -> "TrainingIndex":
        owner: dict[int, int] = {}
        n = short = 0
        for i, text in enumerate(texts):
            n += 1
            found = False
            for h in shingles(text or "", span):
                owner.setdefault(h, i)
                found = True
            short += not found
        return cls(span=span, owner=owner, n_records=n, n_short=short, source=source)


@dataclass
class FileScan:
    bytes: int = 0
    spans: int = 0
    hits: int = 0
    records: set[int] = field(default_factory=set)

    def add(self, text: str, index: TrainingIndex) -> None:
        for h in shingles(text, index.span):
            self.spans += 1
            if (i := index.owner.get(h)) is not None:
                self.hits += 1
                self.records.add(i)

    def summary(self) -> dict:
        return {"bytes": self.bytes, "spans": self.spans, "hits": self.hits, "records": len(self.records)}


# --- the training records ---------------------------------------------------------------


def _resolve(path: Path, run_dir: Path) -> Path:
    """A config path as the run saw it: relative to the working directory, else to the
    checkout holding the run (runs/<name>/ two levels below it)."""
    if path.is_absolute() or path.is_file():
        return path
    for base in (run_dir.parent.parent, run_dir.parent):
        if (base / path).is_file():
            return base / path
    return path


def training_texts(run_dir: Path) -> tuple[list[str], str]:
    """The texts of the run's training records, and where they were read from."""
    run_dir = Path(run_dir)
    split = run_dir / "data" / "train.parquet"
    if split.is_file():
        return read_split(split)[1], "data/train.parquet"
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
            f"the run) and the run has no data/train.parquet: run the audit from the directory "
            "the run was started in"
        )
    expected = _source_sha(run_dir)
    if expected and sha256_file(Path(data.path)) != expected:
        raise AuditError(
            f"{data.path} changed since the run read it (its sha256 differs from the data "
            "manifest's): the training records cannot be rebuilt from it"
        )
    with tempfile.TemporaryDirectory(prefix="dpdistill-audit-") as tmp:
        result = prepare_data(data, Path(tmp), seed=cfg.seed, code_domain=cfg.control_codes.domain)
        texts = read_split(result.train)[1]
    return texts, f"data.path {str(cfg.data.path)!r} (split rebuilt as the data stage made it)"


def _source_sha(run_dir: Path) -> str | None:
    manifest = run_dir / "data" / MANIFEST
    if not manifest.is_file():
        return None
    return json.loads(manifest.read_text()).get("inputs", {}).get("data", {}).get("sha256")


# --- the published files ----------------------------------------------------------------


def _skip_reason(rel: Path) -> str | None:
    """Why a file of the run directory is not scanned (None: it is)."""
    if rel.parts[0] == "data" and rel.suffix == ".parquet":
        return "private split"
    if "checkpoint" in rel.parts[:-1]:
        return "checkpoint (private)"
    if rel.suffix in WEIGHT_SUFFIXES:
        return "model weights or tensors (binary)"
    if rel.name in (AUDIT, "canaries.json") and len(rel.parts) == 1:
        return "audit output"
    if rel.name.startswith(".") and rel.name.endswith(".tmp"):
        return "temporary file"
    return None


def _json_strings(obj) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield str(k)
            yield from _json_strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _json_strings(v)


def documents(path: Path) -> Iterator[str]:
    """The texts a published file holds: each string cell of a Parquet file (and its
    metadata), each string of a JSON file, HTML unescaped, anything else as text."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        pf = pq.ParquetFile(path)
        for k, v in (pf.schema_arrow.metadata or {}).items():
            yield k.decode("utf-8", "replace") + "\n" + v.decode("utf-8", "replace")
        for batch in pf.iter_batches():
            for col in batch.columns:
                if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                    yield from (s for s in col.to_pylist() if s)
        return
    text = path.read_bytes().decode("utf-8", "replace")
    if suffix == ".json":
        try:
            yield from _json_strings(json.loads(text))
            return
        except json.JSONDecodeError:
            pass
    yield html.unescape(text) if suffix in (".html", ".htm", ".svg", ".xml") else text


@dataclass
class AuditResult:
    report: dict
    path: Path

    @property
    def leak(self) -> bool:
        return self.report["total_hits"] > 0


def audit_run(
    run_dir: Path, span: int = DEFAULT_SPAN, extra: dict[str, list[str]] | None = None,
    extra_note: str | None = None,
) -> AuditResult:
    """Scan what `run_dir` publishes (and the `extra` documents, e.g. Prefect logs) for
    `span`-word windows of the training records; write `run_dir/audit.json`."""
    if span < 1:
        raise AuditError(f"span={span}: use a positive number of words, e.g. 10")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise AuditError(f"{run_dir} is not a directory: pass a run directory")
    t0 = time.time()
    texts, source = training_texts(run_dir)
    index = TrainingIndex.build(texts, span, source)
    del texts
    scans: dict[str, FileScan] = {}
    not_scanned: dict[str, str] = {}
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(run_dir)
        if reason := _skip_reason(rel):
            not_scanned[str(rel)] = reason
            continue
        scan = scans[str(rel)] = FileScan(bytes=path.stat().st_size)
        try:
            for doc in documents(path):
                scan.add(doc, index)
        except Exception as e:  # the cause's message could quote the file: name its type only
            raise AuditError(f"could not read {rel} ({type(e).__name__}); is the run directory intact?") from None
    for name, docs in (extra or {}).items():
        scan = scans[name] = FileScan()
        for doc in docs:
            scan.bytes += len(doc.encode())
            scan.add(doc, index)
    total = sum(s.hits for s in scans.values())
    leaked = set().union(*(s.records for s in scans.values())) if scans else set()
    report = {
        "run_dir": str(run_dir.resolve()),
        "span": span,
        "training_records": index.n_records,
        "training_records_shorter_than_span": index.n_short,
        "training_source": index.source,
        "files_scanned": len(scans),
        "bytes_scanned": sum(s.bytes for s in scans.values()),
        "spans_checked": sum(s.spans for s in scans.values()),
        "total_hits": total,
        "training_records_found": len(leaked),
        "files_with_hits": sorted(name for name, s in scans.items() if s.hits),
        "files": {name: s.summary() for name, s in scans.items()},
        "not_scanned": not_scanned,
        "extra_sources": extra_note or ("none" if not extra else ", ".join(extra)),
        "elapsed_seconds": round(time.time() - t0, 2),
    }
    out = run_dir / AUDIT
    atomic_write_json(out, report)
    return AuditResult(report=report, path=out)


def format_audit(report: dict) -> str:
    """A short summary: counts and file names only."""
    lines = [
        f"audit of {report['run_dir']}: {report['span']}-word spans of {report['training_records']} training "
        f"records ({report['training_records_shorter_than_span']} shorter than the span), read from "
        f"{report['training_source']}",
        f"scanned {report['files_scanned']} files/sources, {report['bytes_scanned']:,} bytes, "
        f"{report['spans_checked']:,} spans in {report['elapsed_seconds']:.1f} s; "
        f"Prefect: {report['extra_sources']}",
    ]
    if report["total_hits"]:
        lines.append(f"LEAK: {report['total_hits']} span(s) of {report['training_records_found']} training "
                     "record(s) found in:")
        lines += [f"  {name}: {report['files'][name]['hits']} span(s), {report['files'][name]['records']} record(s)"
                  for name in report["files_with_hits"]]
    else:
        lines.append("clean: no training record span found")
    return "\n".join(lines)
