"""The texts a published file holds, judged by its content, never by its name (issues 38, 62).

    notes = Notes()
    for text in texts_of(path, decode, notes): ...   # decode: token-id rows -> texts

Read by their first bytes: Parquet and Arrow IPC (file or stream) as every cell of every
type (strings, dictionary-encoded, binary read again by content, lists, structs and maps
walked) and their metadata; numpy `.npy` / `.npz` (loaded without pickle); a torch file through
`torch.load(weights_only=True)` (never an arbitrary unpickle); safetensors (the header's
`__metadata__` and tensor names, and the tensors); gzip, bz2 and xz streams, zip and tar
archives, each member (and its name) read again by content; JSON and JSON Lines; CSV and TSV
by column; anything else as text (UTF-8, UTF-16/32 by BOM or by its NUL pattern, else Latin-1
when it has no binary control bytes), HTML unescaped.

Numbers are read as token ids (pipeline/audits/numbers.py): every integer array, tensor, Arrow
or CSV column (one id a row), JSON list or column of a list of objects (ints, or floats that are
integers), and run of integers in a text, long enough to hold a span (`decode.min_ids`). Every
string is also read for what it may hold encoded (base64, hex, URL-encoded, quoted-printable,
backslash escapes: pipeline/audits/pieces.py): what decodes to text, or to a known format, is
read like any other content; what does not is no encoding of anything and is dropped.

Float arrays whose values are not integers (a weight file's numbers) hold no text:
`Notes.tensors` names their kinds. What cannot be read is never skipped in silence:
`Notes.unread` says what, so that the audit reports it as INCOMPLETE (a pickle that weights_only
refuses, a numpy object array, zstd, binary of an unknown format, token ids and no tokenizer, a
member too large, a damaged file). Reasons name formats, members by number, and exception
types: never content.
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.audits.numbers import CHUNK, OVERLAP, csv_columns, id_rows, integer_cells, is_ids, number_runs
from pipeline.audits.pieces import GLUE_BREAK, encodings


class Decode(Protocol):
    """Token-id rows to texts with the run's tokenizer; raises `Unreadable` when it has none."""

    min_ids: int  # the fewest ids read as token ids: fewer cannot hold a span

    def __call__(self, rows: list[list[int]]) -> list[str]: ...

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
    text = html.unescape(text)  # harmless for other text: only entities change
    yield from _string(text, decode, notes, depth)
    for cells in csv_columns(text) or []:  # a column one word (or one id) a row
        if (ids := integer_cells(cells, decode.min_ids)) is not None:
            yield from _token_texts([ids], decode, notes)
        else:
            yield " ".join(cells)


def _string(text: str, decode: Decode, notes: Notes, depth: int) -> Iterator[str]:
    """A string, then the token ids among its numbers and what it holds encoded."""
    yield text
    rows = list(number_runs(text, decode.min_ids))
    if rows:
        yield from _token_texts(rows, decode, notes)
    if depth < MAX_DEPTH:
        for decoded in encodings(text):
            yield from _decoded(decoded, decode, notes, depth + 1)


def _decoded(value: str | bytes, decode: Decode, notes: Notes, depth: int) -> Iterator[str]:
    """What an encoding found in a string decodes to: a known format is read by content, text as
    text; anything else was no encoding (a hash, an identifier) and is dropped without a note."""
    if isinstance(value, str):
        yield from _string(value, decode, notes, depth)
    elif _known_format(value[:512]):
        yield from _member(value, "encoded content", decode, notes, depth)
    elif (text := _strict_text(value)) is not None:
        yield from _string(text, decode, notes, depth)


def _known_format(head: bytes) -> bool:
    return head.startswith((b"PAR1", b"ARROW1", b"\x93NUMPY", b"PK\x03\x04", b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00",
                            b"\x28\xb5\x2f\xfd")) or head[257:262] == b"ustar"


def _strict_text(data: bytes) -> str | None:
    """UTF-8 that reads as text (printable but for a few), else None."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    printable = sum(c.isprintable() or c in "\n\r\t" for c in text)
    return text if text and printable >= 0.95 * len(text) else None


def _token_texts(rows: list[list[int]], decode: Decode, notes: Notes) -> Iterator[str]:
    try:
        yield from decode(rows)
    except Unreadable as e:
        notes.cannot(str(e))


def _numbers(values: list) -> np.ndarray | None:
    """A list of numbers (not booleans) as an array, else None."""
    if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None
    try:
        return np.array(values, dtype=np.float64 if any(isinstance(v, float) for v in values) else np.int64)
    except OverflowError:  # an int past int64: no token id
        return None


def _ids(flat: np.ndarray, decode: Decode, notes: Notes, kind: str | None) -> Iterator[str]:
    """A flat numeric array read as token ids (pipeline/audits/numbers.py); a float one whose
    values are not integers is a tensor of weights, named in `notes.tensors` as `kind` (None: a
    column of figures, no tensor)."""
    if is_ids(flat, decode.min_ids):
        for row in id_rows(flat, decode.min_ids):
            yield from _token_texts([row], decode, notes)
    elif kind and flat.dtype.kind == "f" and flat.size >= decode.min_ids:
        notes.tensors.add(kind)


def _values(value, decode: Decode, notes: Notes, depth: int) -> Iterator[str]:
    if isinstance(value, str):
        yield from _string(value, decode, notes, depth)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        yield from _read(bytes(value), decode, notes, depth + 1)
    elif isinstance(value, dict):
        if (numbers := _numbers(list(value.values()))) is not None:  # {"0": 464, "1": 3290, ...}
            yield from _ids(numbers, decode, notes, "numbers")
        for k, v in value.items():
            yield from _values(k, decode, notes, depth)
            yield GLUE_BREAK  # a key is no token string of its value's
            yield from _values(v, decode, notes, depth)
    elif isinstance(value, (list, tuple)):
        yield from _list(list(value), decode, notes, depth)
    elif isinstance(value, np.ndarray):
        if value.dtype.kind in "USV":
            yield from _values(value.ravel().tolist(), decode, notes, depth)
        elif value.dtype.kind in "iuf":
            yield from _ids(value.reshape(-1), decode, notes, "numpy")
    elif type(value).__module__.startswith("torch"):  # a tensor (weights_only admits nothing else of torch's)
        yield from _tensor(value, decode, notes)
    # single numbers, None, dates, ...: no text


def _list(items: list, decode: Decode, notes: Notes, depth: int) -> Iterator[str]:
    """A list's numbers as token ids: itself, its one-number lists ([[464], [3290]]), or each key
    of a list of objects ([{"id": 464}, ...], a table by rows); then every item."""
    if (numbers := _numbers(items)) is not None:
        yield from _ids(numbers, decode, notes, "numbers")
        return
    if items and all(isinstance(v, (list, tuple)) and len(v) == 1 for v in items):
        if (numbers := _numbers([v[0] for v in items])) is not None:
            yield from _ids(numbers, decode, notes, "numbers")
    elif items and all(isinstance(v, dict) for v in items):
        for key in dict.fromkeys(k for v in items for k in v):
            if (numbers := _numbers([v.get(key) for v in items])) is not None:
                yield from _ids(numbers, decode, notes, "numbers")
    yield GLUE_BREAK  # a list's token strings start a run of their own
    for v in items:
        yield from _values(v, decode, notes, depth)


def _tensor(t, decode: Decode, notes: Notes) -> Iterator[str]:
    """A torch tensor's numbers: integer tensors as ids; a float one only when its first values
    are integers (a weight's are not: the rest is never converted)."""
    import torch

    flat = t.detach().reshape(-1)
    if flat.is_floating_point():
        if flat.numel() < decode.min_ids:
            return
        if not is_ids(flat[:1024].double().numpy(), min(decode.min_ids, flat.numel())):
            notes.tensors.add("torch")
            return
        flat = flat.double()
    elif flat.dtype in (torch.bool, torch.complex64, torch.complex128) or flat.is_complex():
        return
    yield from _ids(flat.to(torch.int64).numpy() if not flat.is_floating_point() else flat.numpy(),
                    decode, notes, "torch")


# --- Parquet and Arrow ----------------------------------------------------------------------


def _metadata(metadata: dict | None) -> Iterator[str]:
    for k, v in (metadata or {}).items():
        yield k.decode("utf-8", "replace") + "\n" + v.decode("utf-8", "replace")


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_list(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
            or pa.types.is_list_view(t) or pa.types.is_large_list_view(t))


def _column(col: pa.Array, decode: Decode, notes: Notes, depth: int, numbers: "_NumberColumns", i: int
            ) -> Iterator[str]:
    """Each cell of an Arrow column: strings (each, in order: a word a row reads as one text),
    integer lists as token ids (the rows one after another: a record split over rows is found
    too), number columns to `numbers` (token ids one a row, across batches), booleans and dates
    skipped, everything else (binary, nested lists, structs, maps) walked."""
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    t = col.type
    if _is_text(t):
        for cell in col.to_pylist():
            if cell:
                yield from _string(cell, decode, notes, depth)
    elif _is_list(t) and (pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)):
        values = col.flatten().drop_null().to_numpy(zero_copy_only=False)
        yield from _ids(values, decode, notes, None)
    elif pa.types.is_integer(t) or pa.types.is_floating(t):
        yield from numbers.add(i, col.drop_null().to_numpy(zero_copy_only=False))
    elif not (pa.types.is_boolean(t) or pa.types.is_null(t) or pa.types.is_temporal(t) or pa.types.is_decimal(t)):
        for cell in col.to_pylist():
            if cell is not None:
                yield from _values(cell, decode, notes, depth)


class _NumberColumns:
    """The number columns of a table, read as token ids one a row across its batches: CHUNK
    values at a time, the last OVERLAP kept for the next (a span across batches is found)."""

    def __init__(self, decode: Decode, notes: Notes):
        self.decode, self.notes = decode, notes
        self.pending: dict[int, list[np.ndarray]] = {}
        self.fresh: dict[int, int] = {}  # values not decoded yet

    def add(self, i: int, values: np.ndarray) -> Iterator[str]:
        self.pending.setdefault(i, []).append(values)
        self.fresh[i] = self.fresh.get(i, 0) + len(values)
        if sum(map(len, self.pending[i])) >= CHUNK:
            yield from self._flush(i, keep=OVERLAP)

    def _flush(self, i: int, keep: int = 0) -> Iterator[str]:
        values = np.concatenate(self.pending.pop(i))
        if self.fresh.pop(i, 0):
            yield from _ids(values, self.decode, self.notes, None)
        if keep:
            self.pending[i], self.fresh[i] = [values[-keep:]], 0

    def close(self) -> Iterator[str]:
        for i in list(self.pending):
            yield from self._flush(i)


def _arrow_batches(schema: pa.Schema, batches, decode: Decode, notes: Notes, depth: int) -> Iterator[str]:
    yield from _metadata(schema.metadata)
    numbers = _NumberColumns(decode, notes)
    for batch in batches:
        for i, col in enumerate(batch.columns):
            yield from _column(col, decode, notes, depth, numbers, i)
    yield from numbers.close()


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
    try:  # mmap: a weight array is read only as far as its first values, which are not integers
        arr = (np.load(source, mmap_mode="r", allow_pickle=False) if isinstance(source, Path)
               else np.load(io.BytesIO(source), allow_pickle=False))
    except ValueError as e:  # numpy's refusal to load (or to map) Python objects
        if "pickle" not in str(e) and "Python objects" not in str(e):
            raise
        notes.cannot("numpy object array (needs pickle, which could run code): not unpickled")
        return
    if isinstance(arr, np.lib.npyio.NpzFile):  # not reached: .npz is a zip, read member by member
        return
    if arr.dtype.kind in "USV":  # text (or records of it)
        yield from _values(np.asarray(arr), decode, notes, depth)
    elif arr.dtype.kind in "iuf":
        yield from _ids(arr.reshape(-1), decode, notes, "numpy .npy")
    elif arr.dtype.names:  # a structured array: each field a column
        for name in arr.dtype.names:
            yield from _values(np.asarray(arr[name]), decode, notes, depth)


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
    """The header's text (its `__metadata__`, free-form strings, and the tensor names), then
    each tensor's numbers: read as token ids where they are integers (a weight's first values
    are not, and the rest of it is never read)."""
    header = _safetensors_header(source, head)
    yield from _values(header.pop("__metadata__", None) or {}, decode, notes, depth)
    yield "\n".join(header)
    from safetensors import safe_open
    from safetensors.torch import load

    if isinstance(source, bytes):
        for t in load(source).values():
            yield from _tensor(t, decode, notes)
        return
    with safe_open(str(source), framework="pt") as f:
        for name in f.keys():
            part = f.get_slice(name)
            shape = part.get_shape()
            rows = 1024 if len(shape) < 2 else -(-1024 // max(1, int(np.prod(shape[1:]))))
            first = part[:rows] if shape else f.get_tensor(name)
            if first.is_floating_point() and not is_ids(first.reshape(-1)[:1024].double().numpy(), 1):
                notes.tensors.add("safetensors")
                continue
            yield from _tensor(f.get_tensor(name) if shape else first, decode, notes)


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
        for info in z.infolist():  # a member's (or folder's) name can hold a span
            yield from _string(info.filename, decode, notes, depth)
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
            yield from _string(member.name, decode, notes, depth)  # a name can hold a span
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
