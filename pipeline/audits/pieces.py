"""A record's text put back together from the pieces a file holds it in (issue 62 item 2).

    stream = WordStream(span)
    for text in texts: hashes = stream.feed(text)   # every `span`-word window, across texts
    hashes = stream.close()

A record written one word per JSON string, per Parquet row or per CSV cell, as its tokenizer's
token strings (`convert_ids_to_tokens`), or in HTML with each word in its own `<span>`, holds no
span in any one text. `WordStream` reads a file's texts in order as one text, in channels:

- the texts as they are, each one's words following the previous one's (adjacent strings, rows
  and cells);
- markup stripped: tags read as a space, and as nothing (`<b>fo</b>od`), where a text has tags;
- token strings glued: a run of short texts without whitespace is joined with nothing between
  them and read back as byte-level BPE (GPT-2, Llama 3, Qwen2: `Ġ` is a space, every character
  one byte) or SentencePiece (`▁` is a space, `<0x0A>` a byte) would: "Ġdel", "icious" reads
  "delicious". WordPiece's `##` pieces are not read (no family of ours uses it).

A window found in several channels is one span. `encodings` finds what a text may hold encoded
(base64, hex, URL-encoded, quoted-printable, backslash escapes): pipeline/audits/contents.py reads
what they decode to by content. Both are pure text functions; nothing here reads a file.
"""

from __future__ import annotations

import base64
import binascii
import quopri
import re
import urllib.parse
from collections.abc import Iterator

GLUE_BREAK = ""
"""A text that ends a run of token strings and adds no word: a reader yields it where a run
cannot continue (after a JSON key, before a list's items)."""
_WORD = re.compile(r"[^\W_]+")  # words joined with underscores are words too
_TAG = re.compile(r"<[^<>]{0,2000}>")
_PIECE_CHARS = 64  # a token string is shorter; a longer text without whitespace is not a piece
_GLUED_FLUSH = 1 << 20  # bytes of glued pieces read at a time


def words(text: str) -> list[str]:
    """Lowercase words, split on anything but letters and digits: 'Great—tacos_now!' -> ['great',
    'tacos', 'now']. Underscores split too (issue 62: words joined with underscores were one word)."""
    return _WORD.findall(text.lower())


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (its `bytes_to_unicode`), character -> byte: printable
    bytes stand for themselves, the others for 256 + n."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTES = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def piece_bytes(piece: str) -> bytes:
    """A token string as the bytes it stands for: SentencePiece's `▁` a space and `<0xNN>` a
    byte; a string of byte-level characters (GPT-2's `Ġ` a space) its bytes; else its UTF-8."""
    if m := _BYTE_FALLBACK.fullmatch(piece):
        return bytes.fromhex(m.group(1))
    if "▁" in piece or not all(c in _BYTES for c in piece):
        return piece.replace("▁", " ").encode("utf-8", "replace")
    return bytes(_BYTES[c] for c in piece)


def _is_piece(text: str) -> bool:
    return 0 < len(text) <= _PIECE_CHARS and not any(c.isspace() for c in text)


class WordStream:
    """The hashes of every `span`-word window of a sequence of texts read as one (module doc)."""

    def __init__(self, span: int):
        self.span = span
        self.tails: dict[str, list[str]] = {}  # channel -> its last span - 1 words
        self.glued = bytearray()

    def _windows(self, channel: str, new: list[str]) -> list[int]:
        seq = self.tails.get(channel, []) + new
        self.tails[channel] = seq[max(0, len(seq) - self.span + 1):] if self.span > 1 else []
        return [hash(tuple(seq[i:i + self.span])) for i in range(len(seq) - self.span + 1)]

    def feed(self, text: str) -> list[int]:
        """The windows that end in `text`, in every channel."""
        before = self.tails.get("text", [])
        plain = words(text)
        out = self._windows("text", plain)
        tagged = "<" in text and _TAG.search(text)
        for channel, sep in (("markup as space", " "), ("markup as nothing", "")):
            if tagged:
                out += self._windows(channel, words(_TAG.sub(sep, text)))
            elif self.tails.get(channel, before) == before:  # the same words as "text": no new window
                self.tails[channel] = self.tails["text"]
            else:
                out += self._windows(channel, plain)
        if _is_piece(text):
            self.glued += piece_bytes(text)
            if len(self.glued) > _GLUED_FLUSH:
                out += self._flush(keep_last_word=True)
        else:
            out += self._flush()
        return out

    def _flush(self, keep_last_word: bool = False) -> list[int]:
        data, self.glued = bytes(self.glued), bytearray()
        if keep_last_word and (cut := data.rfind(b" ")) > 0:
            data, self.glued = data[:cut], bytearray(data[cut:])
        out = self._windows("glued pieces", words(data.decode("utf-8", "replace"))) if data else []
        if not keep_last_word:
            self.tails.pop("glued pieces", None)  # a text that is not a piece ends the run
        return out

    def close(self) -> list[int]:
        return self._flush()


# --- encodings ------------------------------------------------------------------------------

_BASE64 = re.compile(r"[A-Za-z0-9+/_-]{24,}={0,2}(?:\r?\n[A-Za-z0-9+/_-]{4,}={0,2})*")
_HEX = re.compile(r"(?:[0-9A-Fa-f]{2}[ :]?){20,}")
_PERCENT = re.compile(r"%[0-9A-Fa-f]{2}")
_QUOTED_PRINTABLE = re.compile(r"=[0-9A-F]{2}|=\r?\n")
_ESCAPES = re.compile(r"(?:\\x[0-9A-Fa-f]{2})+|\\u[0-9A-Fa-f]{4}")


def _unescape(m: re.Match) -> str:
    s = m.group()
    if s.startswith("\\u"):
        return chr(int(s[2:], 16))
    return bytes.fromhex(s.replace("\\x", "")).decode("utf-8", "replace")


def encodings(text: str) -> Iterator[str | bytes]:
    """What `text` may hold encoded: the whole of it URL-decoded, quoted-printable-decoded or
    with backslash escapes replaced (str), and each run of base64 or hex decoded (bytes). Most
    runs are not encodings of anything (a hash, a long identifier): the caller keeps what reads
    as text or as a known format, and drops the rest without a word."""
    if _PERCENT.search(text):
        yield urllib.parse.unquote_plus(text)
    if _QUOTED_PRINTABLE.search(text):
        yield quopri.decodestring(text.encode("utf-8", "replace")).decode("utf-8", "replace")
    if "\\" in text and _ESCAPES.search(text):
        yield _ESCAPES.sub(_unescape, text)
    for m in _BASE64.finditer(text):
        run = re.sub(r"\s", "", m.group()).rstrip("=")
        try:
            yield base64.b64decode(run.replace("-", "+").replace("_", "/") + "=" * (-len(run) % 4))
        except (binascii.Error, ValueError):
            pass
    for m in _HEX.finditer(text):
        run = re.sub(r"[ :]", "", m.group())
        yield bytes.fromhex(run[: len(run) // 2 * 2])
