"""Pre-flight checks: what a run will read and where it will write, checked before any Prefect
server starts and before any run directory is made (issue 10).

    problems = check_inputs(cfg)   # [] when the run can start
    require_inputs(cfg)            # or one PreflightError, one line naming every problem

A run that fails here leaves nothing behind, and its error names the field and the fix in
seconds, instead of a traceback minutes later. The checks read headers and schemas only
(a JSON-lines file has neither: it is scanned line by line, see data.jsonl_problems); the
rows themselves are validated by the data stage. No Prefect; torch only for a CUDA device.
Messages name files, rows and columns, never a record's content.
"""

from __future__ import annotations

import csv
import os
import stat
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import ConfigError, PipelineConfig
from pipeline.models.cache import CACHE_PREFIX, cache_name_problem
from pipeline.records import column_type_problem, jsonl_problems

BUILTIN_PREFIX = "builtin:"  # as pipeline/models/base.py, which imports torch
BUILTINS = ("teacher", "student")


class PreflightError(ConfigError):
    """The config names a file, model or directory the run cannot use; one line lists them all."""


def require_inputs(cfg: PipelineConfig) -> None:
    """Raise one PreflightError listing every problem check_inputs finds."""
    if problems := check_inputs(cfg):
        raise PreflightError(f"pre-flight check failed ({len(problems)} problem(s)): " + "; ".join(problems))


def check_inputs(cfg: PipelineConfig) -> list[str]:
    """Every problem with the files a run reads, its models and its run_root (no run started)."""
    data = cfg.data
    columns = [*data.text_columns, *data.code_columns] + ([data.user_column] if data.user_column else [])
    problems = _data_file(data.path, "data.path", columns)
    if data.test_path is not None:
        problems += _data_file(data.test_path, "data.test_path", columns)
    if cfg.teacher.monitor == "public":  # the public records the validation loss is computed on
        problems += _data_file(cfg.teacher.monitor_path, "teacher.monitor_path",
                               [*data.text_columns, *data.code_columns])
    problems += _models(cfg)
    problems += _device(cfg)
    problems += _run_root(Path(cfg.run_root))
    return problems


def _device(cfg: PipelineConfig) -> list[str]:
    """A CUDA device the run asks for exists here (and does bf16 if asked). Only then is torch
    imported: `auto` and `cpu` always run."""
    if not cfg.device.startswith("cuda"):
        return []
    from pipeline.devices import device_problem

    problem = device_problem(cfg.device, cfg.precision)
    return [problem] if problem else []


def _readable_file(path: Path, field: str) -> str | None:
    if not path.exists():
        return f"{field} {str(path)!r} not found; set {field} to an existing file"
    if path.is_dir():
        return f"{field} {str(path)!r} is a directory; set {field} to a file inside it"
    if not path.is_file():
        return f"{field} {str(path)!r} is not a regular file; set {field} to a file"
    if not os.access(path, os.R_OK):
        return f"{field} {str(path)!r} is not readable by this user; fix its permissions"
    if path.stat().st_size == 0:
        return f"{field} {str(path)!r} is empty; point {field} at the data file"
    return None


def _data_file(path: Path, field: str, columns: list[str]) -> list[str]:
    """The file exists, is readable by the reader its suffix picks, has records and the columns."""
    path = Path(path)
    if problem := _readable_file(path, field):
        return [problem]
    where = f"{field} {str(path)!r}"
    suffix = path.suffix.lower()
    if suffix == ".csv":
        try:
            with open(path, newline="", encoding="utf-8") as f:
                reader = csv.reader(f)
                header = next(reader, [])
                has_row = any(row for row in reader)  # stops at the first non-blank row
        except (UnicodeDecodeError, csv.Error) as e:
            return [f"{where} cannot be read as UTF-8 CSV ({type(e).__name__}); check its format and encoding"]
        names, types = header, {}
        if not has_row:
            return [f"{where} has a header but no records; point {field} at a file with rows"]
    elif suffix in (".jsonl", ".json"):
        try:
            if problems := jsonl_problems(path):
                return [f"{where}: {p}" for p in problems]
            table_schema = _jsonl_schema(path)
        except UnicodeDecodeError:
            return [f"{where} is not UTF-8 text; save it as UTF-8 JSON lines"]
        except (pa.ArrowInvalid, OSError) as e:  # Arrow's message may quote a line: only its kind
            return [f"{where} cannot be read as JSON lines ({type(e).__name__}); check the file's format"]
        if table_schema is None:
            return [f"{where} holds no records (only blank lines)"]
        names, types = table_schema.names, {f.name: f.type for f in table_schema}
    elif suffix == ".parquet":
        try:
            meta = pq.ParquetFile(path).metadata
            schema = meta.schema.to_arrow_schema()
        except (pa.ArrowInvalid, OSError) as e:
            return [f"{where} cannot be read as Parquet ({type(e).__name__}); check the file"]
        if meta.num_rows == 0:
            return [f"{where} has a schema but no records; point {field} at a file with rows"]
        names, types = schema.names, {f.name: f.type for f in schema}
    else:
        return [f"{where} has unsupported type {suffix!r}; use .csv, .jsonl or .parquet"]
    missing = [c for c in columns if c not in names]
    if missing:
        return [f"{where}: column(s) {missing} not found; the file has {names}. Set data.text_column / "
                "data.code_columns / data.user_column to existing columns"]
    return [p for c in columns if c in types and (p := column_type_problem(c, types[c], where))]


def _jsonl_schema(path: Path) -> pa.Schema | None:
    """The schema Arrow's JSON reader infers (the data stage's reader); None without records."""
    import pyarrow.json as pajson

    table = pajson.read_json(path)
    return table.schema if table.num_rows else None


def _models(cfg: PipelineConfig) -> list[str]:
    problems = []
    uses_builtin = False
    for field, name in (("teacher.model", cfg.teacher.model), ("distill.student_model", cfg.distill.student_model)):
        if name.startswith(BUILTIN_PREFIX):
            uses_builtin = True
            if name[len(BUILTIN_PREFIX):] not in BUILTINS:
                problems.append(f"{field}={name!r} is not a builtin model; use 'builtin:teacher' or 'builtin:student'")
        elif name.startswith(CACHE_PREFIX):  # fetched or built into the model cache: pipeline/models/cache.py
            if problem := cache_name_problem(name, field):
                problems.append(problem)
        elif problem := _model_problem(name, field):
            problems.append(problem)
    if uses_builtin and (problem := _corpus_problem(cfg.base_models.corpus)):
        problems.append(problem)
    return problems


def _corpus_problem(corpus: Path | None) -> str | None:
    """The public text the builtin models are built from: none (the shipped pair), a file, or a
    directory holding *.txt documents."""
    if corpus is None:
        return None
    corpus = Path(corpus)
    if corpus.is_dir():
        if not any(corpus.glob("*.txt")):
            return (f"base_models.corpus {str(corpus)!r} holds no *.txt files; point it at a public text "
                    "file or a directory of them, or remove it to use the shipped builtin models")
        return None
    if problem := _readable_file(corpus, "base_models.corpus"):
        return problem + " (the builtin models are built from this public text; remove it to use the shipped pair)"
    return None


def _looks_like_path(name: str) -> bool:
    """Hub names are 'gpt2' or 'org/name'; anything else is meant as a directory."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or Path(name).exists()


def _model_problem(name: str, field: str) -> str | None:
    """A local checkpoint directory, or a hub name in the local cache (or reachable online)."""
    if _looks_like_path(name):
        path = Path(name).expanduser()
        if not path.exists():
            return (f"{field} {name!r} not found; name a local checkpoint directory, a cached hub model, builtin:... "
                    "or cache:... (dpdistill models fetch)")
        if not path.is_dir():
            return f"{field} {name!r} is a file; name the checkpoint's directory (holding config.json)"
        if not (path / "config.json").is_file():
            return f"{field} {name!r} holds no config.json; name a directory written by save_pretrained"
        return None
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return None
    if constants.HF_HUB_OFFLINE:
        return (f"{field} {name!r} is neither a local directory nor in the hub cache, and HF_HUB_OFFLINE is set; "
                "download it first or name a local checkpoint directory")
    return None  # transformers will download it


def _run_root(root: Path) -> list[str]:
    """run_root exists as a directory we may write (and is ours), or can be created."""
    field = f"run_root {str(root)!r}"
    if root.exists():
        if not root.is_dir():
            return [f"{field} is not a directory; set run_root to a directory (it is created if missing)"]
        st = root.stat()
        if st.st_uid != os.geteuid() or st.st_mode & stat.S_ISVTX:  # as flows' prepare_run_root refuses
            return [f"{field} is shared or not yours (owner or sticky bit); set run_root to a directory only you use"]
        if not os.access(root, os.W_OK | os.X_OK):
            return [f"{field} is not writable; fix its permissions or set run_root elsewhere"]
        return []
    parent = root.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return [f"{field} cannot be created: {parent} is a file; set run_root elsewhere"]
    try:  # os.access says yes to root even where mkdir fails (/proc, read-only mounts): try it
        os.rmdir(tempfile.mkdtemp(prefix=".dpdistill-preflight-", dir=parent))
    except OSError as e:
        return [f"{field} cannot be created: {parent} is not writable ({type(e).__name__}); "
                "set run_root to a directory you can write"]
    return []
