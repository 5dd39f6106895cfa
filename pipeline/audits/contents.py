"""The texts a published file holds, judged by its content, never by its name (issue 38).

    notes = Notes()
    for text in texts_of(path, decode, notes): ...   # decode: token ids -> texts

Read by their first bytes: Parquet and Arrow IPC (file or stream) as every cell of every
type (strings, dictionary-encoded, binary read again by content, lists, structs and maps
walked, integer lists decoded as token ids) and their metadata; numpy `.npy` / `.npz` (text
arrays as text; loaded without pickle); a torch file through `torch.load(weights_only=True)`
(its strings and token-id lists; never an arbitrary unpickle); safetensors' header (the
`__metadata__` and tensor names); gzip, bz2 and xz streams, zip and tar archives, each member
read again by content; JSON and JSON Lines as their strings and integer lists (token ids);
anything else as text (UTF-8, UTF-16/32 by BOM or by its NUL pattern, else Latin-1 when it has
no binary control bytes), HTML unescaped.

Tensors (a weight file's numbers) are not read: `Notes.tensors` names their kinds. What
cannot be read is never skipped in silence: `Notes.unread` says what, so that the audit
reports it as INCOMPLETE (a pickle that weights_only refuses, a numpy object array, zstd,
binary of an unknown format, token ids and no tokenizer, a member too large, a damaged file).
Reasons name formats, members by number, and exception types: never content.
"""

from __future__ import annotations

import bz2
import gzip
import html
import io
import json
import lzma
import struct
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

Decode = Callable[[list[list[int]]], list[str]]
"""Token-id rows to texts with the run's tokenizer; raises `Unreadable` when it has none."""

MAX_DEPTH = 4  # archives in archives: a gzip'd tar of a zip is read, deeper is noted unread
MAX_INFLATED = 1 << 30  # bytes a compressed stream or an archive member may expand to
_BATCH = 65_536


class Unreadable(Exception):
    """A part of a file that cannot be read; the message names the format, never content."""


@dataclass
class Notes:
    """What reading one file (or source) could not do."""

    tensors: set[str] = field(default_factory=set)  # kinds of tensor data not read (weights)
    unread: list[str] = field(default_factory=list)  # why some content was not read

    def cannot(self, why: str) -> None:
        if why not in self.unread:
            self.unread.append(why)


Source = Path | bytes


def texts_of(path: Path, decode: Decode, notes: Notes) -> Iterator[str]:
    """Every text `path` holds, by its content (see the module doc)."""
    yield from _read(Path(path), decode, notes, depth=0)


def texts_in(value, decode: Decode, notes: Notes) -> Iterator[str]:
    """Every text inside a decoded value (a JSON document, an Arrow cell, a Prefect artifact's
    data): strings, dict keys, bytes read by content, integer lists as token ids."""
    yield from _values(value, decode, notes, depth=0)


# --- dispatch on the first bytes -----------------------------------------------------------


def _head(source: Source, n: int = 512) -> bytes:
    if isinstance(source, bytes):
        return source[:n]
    with open(source, "rb") as f:
        return f.read(n)


def _stream(source: Source):
    return io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb")


def _arrow_source(source: Source):
    return pa.BufferReader(source) if isinstance(source, bytes) else pa.memory_map(str(source))


def _read(source: Source, decode: Decode, notes: Notes, depth: int) -> Iterator[str]:
    if depth > MAX_DEPTH:
        notes.cannot(f"nested more than {MAX_DEPTH} archives deep: the innermost not read")
        return
    head = _head(source)
    if head.startswith(b"PAR1"):
        yield from _parquet(source, decode, notes, depth)
    elif head.startswith(b"ARROW1"):
        yield from _arrow_file(source, decode, notes, depth)
    elif head.startswith(b"\xff\xff\xff\xff") and (stream := _arrow_stream(source)) is not None:
        yield from _arrow_batches(stream.schema, stream, decode, notes, depth)
    elif head.startswith(b"\x93NUMPY"):
        yield from _numpy(source, decode, notes, depth)
    elif head.startswith((b"PK\x03\x04", b"PK\x05\x06")) and _is_zip(source):
        yield from _zip(source, decode, notes, depth)
    elif _safetensors_header(source, head) is not None:
        yield from _safetensors(source, head, decode, notes, depth)
    elif head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        yield from _pickled(source, decode, notes, depth)  # a legacy torch file, or a plain pickle
    elif head.startswith(b"\x1f\x8b"):
        yield from _read(_inflate(lambda f: gzip.GzipFile(fileobj=f), source), decode, notes, depth + 1)
    elif head.startswith(b"BZh"):
        yield from _read(_inflate(bz2.BZ2File, source), decode, notes, depth + 1)
    elif head.startswith(b"\xfd7zXZ\x00"):
        yield from _read(_inflate(lzma.LZMAFile, source), decode, notes, depth + 1)
    elif head.startswith(b"\x28\xb5\x2f\xfd"):
        notes.cannot("zstd-compressed (no zstd decoder installed): not read")
    elif head[257:262] == b"ustar":
        yield from _tar(source, decode, notes, depth)
    else:
        yield from _text(source if isinstance(source, bytes) else source.read_bytes(), decode, notes, depth)


def _is_zip(source: Source) -> bool:
    with _stream(source) as f:
        return zipfile.is_zipfile(f)


def _inflate(opener, source: Source) -> bytes:
    with _stream(source) as raw, opener(raw) as f:
        data = f.read(MAX_INFLATED + 1)
    if len(data) > MAX_INFLATED:
        raise Unreadable(f"compressed content expanding past {MAX_INFLATED >> 30} GiB: not read")
    return data


# --- text and JSON ------------------------------------------------------------------------

_BOMS = ((b"\xef\xbb\xbf", "utf-8-sig"), (b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"),
         (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16"))


def as_text(data: bytes) -> str | None:
    """`data` decoded as text, or None when it is not text: UTF-8; UTF-16/32 by BOM, or UTF-16
    without one when every other byte of its start is NUL; else Latin-1 when it holds no
    binary control bytes (text in a legacy 8-bit encoding keeps its ASCII words)."""
    for bom, codec in _BOMS:
        if data.startswith(bom):
            try:
                return data.decode(codec)
            except UnicodeDecodeError:
                return None
    sample = data[:65_536]
    if b"\x00" in sample:  # valid UTF-8 too, but no text file holds NULs: UTF-16 (ASCII's every other byte), or binary
        even, odd = sample[0::2].count(0), sample[1::2].count(0)
        if len(data) % 2 == 0 and max(even, odd) >= len(sample) // 4 and min(even, odd) <= len(sample) // 64:
            try:
                return data.decode("utf-16-le" if odd > even else "utf-16-be")
            except UnicodeDecodeError:
                return None
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    controls = sum(1 for b in sample if b < 32 and b not in (9, 10, 12, 13))
    return data.decode("latin-1") if controls <= len(sample) // 100 else None


def _text(data: bytes, decode: Decode, notes: Notes, depth: int) -> Iterator[str]:
    text = as_text(data)
    if text is None:
        notes.cannot("binary content of unknown format: read only as bytes")
        yield data.decode("utf-8", "replace")  # still scanned: ASCII text inside binary is found
        return
    stripped = text.lstrip()
    if stripped[:1] in ("{", "["):
        try:
            yield from _values(json.loads(text), decode, notes, depth)
            return
        except json.JSONDecodeError:
            lines = [line for line in text.splitlines() if line.strip()]
            try:  # JSON Lines: one document a line
                documents = [json.loads(line) for line in lines]
            except json.JSONDecodeError:
                documents = None
            if documents is not None:
                yield from _values(documents, decode, notes, depth)
                return
    yield html.unescape(text)  # harmless for other text: only entities change


def _is_token_ids(values) -> bool:
    return len(values) >= 2 and all(type(v) is int and v >= 0 for v in values)


def _token_texts(rows: list[list[int]], decode: Decode, notes: Notes) -> Iterator[str]:
    try:
        yield from decode(rows)
    except Unreadable as e:
        notes.cannot(str(e))


def _values(value, decode: Decode, notes: Notes, depth: int) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, (bytes, bytearray, memoryview)):
        yield from _read(bytes(value), decode, notes, depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _values(k, decode, notes, depth)
            yield from _values(v, decode, notes, depth)
    elif isinstance(value, (list, tuple)):
        if _is_token_ids(value):
            yield from _token_texts([list(value)], decode, notes)
        else:
            for v in value:
                yield from _values(v, decode, notes, depth)
    elif isinstance(value, np.ndarray):
        if value.dtype.kind in "USV":
            yield from _values(value.ravel().tolist(), decode, notes, depth)
        else:
            notes.tensors.add("numpy")
    elif type(value).__module__.startswith("torch"):  # a tensor (weights_only admits nothing else of torch's)
        notes.tensors.add("torch")
    # numbers, None, dates, ...: no text


# --- Parquet and Arrow ----------------------------------------------------------------------


def _metadata(metadata: dict | None) -> Iterator[str]:
    for k, v in (metadata or {}).items():
        yield k.decode("utf-8", "replace") + "\n" + v.decode("utf-8", "replace")


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_list(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
            or pa.types.is_list_view(t) or pa.types.is_large_list_view(t))


def _column(col: pa.Array, decode: Decode, notes: Notes, depth: int) -> Iterator[str]:
    """Each cell of an Arrow column: strings as they are, integer lists as token ids (a batch
    at a time), numbers skipped, everything else (binary, nested lists, structs, maps) walked."""
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    t = col.type
    if _is_text(t):
        yield from (s for s in col.to_pylist() if s)
    elif _is_list(t) and pa.types.is_integer(t.value_type):
        rows = [ids for ids in col.to_pylist() if ids and _is_token_ids(ids)]
        if rows:
            yield from _token_texts(rows, decode, notes)
    elif not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_null(t)
              or pa.types.is_temporal(t) or pa.types.is_decimal(t)):
        for cell in col.to_pylist():
            if cell is not None:
                yield from _values(cell, decode, notes, depth)


def _arrow_batches(schema: pa.Schema, batches, decode: Decode, notes: Notes, depth: int) -> Iterator[str]:
    yield from _metadata(schema.metadata)
    for batch in batches:
        for col in batch.columns:
            yield from _column(col, decode, notes, depth)


def _parquet(source: Source, decode: Decode, notes: Notes, depth: int) -> Iterator[str]:
    pf = pq.ParquetFile(pa.BufferReader(source) if isinstance(source, bytes) else source, pre_buffer=False)
    yield from _arrow_batches(pf.schema_arrow, pf.iter_batches(batch_size=_BATCH), decode, notes, depth)


def _arrow_file(source: Source, decode: Decode, notes: Notes, depth: int) -> Iterator[str]:
    reader = pa.ipc.open_file(_arrow_source(source))
    batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    yield from _arrow_batches(reader.schema, batches, decode, notes, depth)


def _arrow_stream(source: Source):
    """An Arrow IPC stream reader, or None when the bytes only start like one."""
    try:
        return pa.ipc.open_stream(_arrow_source(source))
    except (pa.ArrowInvalid, OSError):
        return None


# --- numpy, torch, safetensors ----------------------------------------------------------------


def _numpy(source: Source, decode: Decode, notes: Notes, depth: int) -> Iterator[str]:
    try:  # mmap: a weight array's numbers are never read, only its header
        arr = (np.load(source, mmap_mode="r", allow_pickle=False) if isinstance(source, Path)
               else np.load(io.BytesIO(source), allow_pickle=False))
    except ValueError as e:  # numpy's refusal to load (or to map) Python objects
        if "pickle" not in str(e) and "Python objects" not in str(e):
            raise
        notes.cannot("numpy object array (needs pickle, which could run code): not unpickled")
        return
    if arr.dtype.kind in "USV":  # text (or records of it); numbers are tensors, not read
        yield from _values(np.asarray(arr), decode, notes, depth)
    else:
        notes.tensors.add("numpy .npy")


def _safetensors_header(source: Source, head: bytes) -> dict | None:
    """safetensors: a little-endian u64 length, then that many bytes of a JSON object."""
    if len(head) < 9 or head[8:9] != b"{":
        return None
    (n,) = struct.unpack("<Q", head[:8])
    size = len(source) if isinstance(source, bytes) else source.stat().st_size
    if n > size - 8 or n > 100 << 20:
        return None
    with _stream(source) as f:
        f.seek(8)
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            return None
    return header if isinstance(header, dict) else None


def _safetensors(source: Source, head: bytes, decode: Decode, notes: Notes, depth: int) -> Iterator[str]:
    """The header's text: its `__metadata__` (free-form strings) and the tensor names; the
    tensors' dtypes, shapes and offsets hold none."""
    header = _safetensors_header(source, head)
    notes.tensors.add("safetensors")
    yield from _values(header.pop("__metadata__", None) or {}, decode, notes, depth)
    yield "\n".join(header)


def _torch(stream, decode: Decode, notes: Notes, depth: int, mmap: bool = False) -> Iterator[str]:
    import pickle

    import torch

    try:  # weights_only: tensors and plain containers only, never code
        obj = torch.load(stream, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as e:
        notes.cannot(f"a torch file torch.load(weights_only=True) refuses ({type(e).__name__}): not unpickled")
        return
    yield from _values(obj, decode, notes, depth)


def _pickled(source: Source, decode: Decode, notes: Notes, depth: int) -> Iterator[str]:
    """A pickle: torch's legacy format loads with weights_only; any other pickle is noted."""
    with _stream(source) as f:
        yield from _torch(f, decode, notes, depth)


# --- archives -----------------------------------------------------------------------------------


def _zip(source: Source, decode: Decode, notes: Notes, depth: int) -> Iterator[str]:
    with _stream(source) as raw, zipfile.ZipFile(raw) as z:
        infos = [i for i in z.infolist() if not i.is_dir()]
        names = [i.filename for i in infos]
        if any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):  # torch's format
            raw.seek(0)
            yield from _torch(source if isinstance(source, Path) else raw, decode, notes, depth,
                              mmap=isinstance(source, Path))
            return
        for k, info in enumerate(infos):
            if info.flag_bits & 0x1:
                notes.cannot(f"zip member #{k} is encrypted: not read")
            elif info.file_size > MAX_INFLATED:
                notes.cannot(f"zip member #{k} expands past {MAX_INFLATED >> 30} GiB: not read")
            else:
                yield from _member(z.read(info), f"zip member #{k}", decode, notes, depth)


def _tar(source: Source, decode: Decode, notes: Notes, depth: int) -> Iterator[str]:
    with _stream(source) as raw, tarfile.open(fileobj=raw) as tar:
        for k, member in enumerate(tar.getmembers()):
            if member.isdir():
                continue
            if not member.isfile():  # links and devices inside an archive: nothing to read, say so
                notes.cannot(f"tar member #{k} is not a regular file: not read")
            elif member.size > MAX_INFLATED:
                notes.cannot(f"tar member #{k} expands past {MAX_INFLATED >> 30} GiB: not read")
            else:
                yield from _member(tar.extractfile(member).read(), f"tar member #{k}", decode, notes, depth)


def _member(data: bytes, what: str, decode: Decode, notes: Notes, depth: int) -> Iterator[str]:
    try:
        yield from _read(data, decode, notes, depth + 1)
    except Unreadable as e:
        notes.cannot(f"{what}: {e}")
    except Exception as e:  # a damaged member: the others are still read
        notes.cannot(f"{what} could not be read ({type(e).__name__})")
