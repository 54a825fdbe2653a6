"""`dflash-assets export-completions`: the target's stored answers of some ranges as one JSONL dataset in
the OpenAI `messages` layout, each row with its exact token ids and where it came from.

A row (format `dflash-assets.exported-completion/1`):

    {"messages": [...],                       the conversation as target_completions stored it, every
                                              assistant turn the target's
     "tools": [...],                          the row's tools, where it has any
     "exact_ids": {"turns": [...],            per answer: message, finish_reason, completion_tokens,
                                              completion_token_ids (the record's own `turns`)
                   "prompt_token_ids": [...], the last answer's exact prompt, where the engine returned it
                   "chat_template_kwargs": {}, what the answers were rendered with
                   "ended_early": "..."},     where the record has it
     "provenance": {"format": "dflash-assets.exported-completion/1",
                    "range": "00000000-00000099", "sample_index": 17,   the source row
                    "target_model": "...", "target_revision": "...",
                    "engine": {...} or "not recorded", "answered_by": "in-process",
                    "generation": {...}, "truncated_policy": "keep",
                    "dataset": {"uri": ..., "rows_sha256": ...} or "not recorded"}}

Read back as a dataset (`DFLASH_DATASET=<file>`, `DFLASH_COMPLETIONS=dataset`), a row with `exact_ids`
becomes a Conversation carrying them (`conversations/layouts.py`) and is tokenized by the same call as
the stored record (`AnswerTokenizer.last_answer`): the same `input_ids` and `loss_mask`, sample for
sample. No Dagster here: the CLI opens the store and prints.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from dflash_assets.conversations.layouts import EXACT_IDS_FIELD
from dflash_assets.conversations.sample_range import SampleRange
from dflash_assets.generation.records import CompletionRecord, iter_records
from dflash_assets.redaction import redact, redact_value
from dflash_assets.storage.layout import ASSET_PREFIXES, COMPLETIONS_NAME, FINGERPRINT_NAME, MANIFEST_NAME
from dflash_assets.storage.manifest import (
    ManifestError,
    changed_since_commit,
    partition_prefix,
    read_manifest,
)
from dflash_assets.storage.store import ObjectNotFound, ObjectStore, atomic_write

EXPORT_FORMAT = "dflash-assets.exported-completion/1"
NOT_RECORDED = "not recorded"
ASSET = "target_completions"
_SHOWN_RANGES = 10  # ranges named in an error before "and N more"


class ExportError(ValueError):
    """A range that cannot be exported (not stored, changed since its commit, overlapping another); its
    message is one line naming it."""


@dataclass
class ExportResult:
    path: Path
    ranges: list[str]
    rows: int = 0
    size: int = 0
    left_out: dict[str, int] = field(default_factory=dict)  # reason -> rows target_completions dropped

    def left_out_line(self) -> str:
        """The rows of the ranges that are not in the file, by reason (from the ranges' manifests)."""
        if not self.left_out:
            return "no row of these ranges was left out"
        total = sum(self.left_out.values())
        reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(self.left_out.items()))
        rows = "1 row was" if total == 1 else f"{total:,} rows were"
        return f"{rows} left out, dropped by target_completions ({reasons})"

    def summary(self) -> str:
        return (
            f"wrote {self.rows:,} rows of {len(self.ranges)} range(s) ({_ranges_text(self.ranges)}) to "
            f"{self.path}: {self.size:,} bytes"
        )


def committed_ranges(store: ObjectStore) -> list[str]:
    """The ranges of `target_completions` committed in the store (a `_manifest.json` under their prefix),
    in sample order; one listing."""
    top = ASSET_PREFIXES[ASSET] + "/"
    keys = set()
    for info in store.list(top):
        key, _, leaf = info.key[len(top) :].partition("/")
        if leaf == MANIFEST_NAME:
            keys.add(key)
    return sorted(keys, key=_order)


def export_completions(
    store: ObjectStore,
    out: Path,
    ranges: Sequence[str] | None = None,
    *,
    log: Callable[[str], None] = lambda message: None,
) -> ExportResult:
    """Write the stored answers of `ranges` (every committed range when None or empty) to `out` as one
    JSONL dataset, rows in sample order; atomically: `out` appears whole or not at all."""
    out = Path(out)
    if out.is_dir():
        raise ExportError(f"{out} is a directory: name the file to write, e.g. {out / COMPLETIONS_NAME}")
    stored, where = committed_ranges(store), store.uri(ASSET_PREFIXES[ASSET])
    chosen = sorted(dict.fromkeys(ranges or stored), key=_order)
    if not chosen:
        raise ExportError(f"no range of {ASSET} is committed in {where}: materialise {ASSET} first")
    missing = [key for key in chosen if key not in stored]
    if missing:
        plural = "s are" if len(missing) > 1 else " is"
        raise ExportError(
            f"{ASSET} range{plural} not stored (committed) in {where}: {_ranges_text(missing)}; stored "
            f"ranges: {_ranges_text(stored) or 'none'}"
        )
    _check_disjoint(chosen)
    result = ExportResult(path=out, ranges=chosen)
    left_out: Counter[str] = Counter()
    # The ranges' objects are downloaded beside the output, one at a time, and removed once written.
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as work:

        def write(handle: IO[bytes]) -> None:
            for key in chosen:
                local = Path(work) / f"{key}.jsonl"
                fetched = _fetch(store, key, local)
                rows = 0
                for record in iter_records(local):
                    handle.write(exported_line(record, fetched.provenance, fetched.chat_template_kwargs))
                    rows += 1
                local.unlink()
                left_out.update(fetched.dropped.values())
                result.rows += rows
                dropped = len(fetched.dropped)
                log(f"{key}: {rows} rows" + (f", {dropped} dropped by {ASSET}" if dropped else ""))

        result.size = atomic_write(out, write)
    result.left_out = dict(sorted(left_out.items()))
    return result


def exported_row(
    record: CompletionRecord, provenance: dict[str, Any], chat_template_kwargs: dict[str, Any]
) -> dict[str, Any]:
    """One stored record as a row of the exported dataset (the module's docstring has the format):
    `provenance` is its range's (`_provenance`), `chat_template_kwargs` the range's generation settings'."""
    row: dict[str, Any] = {"messages": record.messages}
    if record.tools is not None:
        row["tools"] = record.tools
    exact: dict[str, Any] = {"turns": record.turns}
    if record.prompt_token_ids is not None:
        exact["prompt_token_ids"] = record.prompt_token_ids
    exact["chat_template_kwargs"] = chat_template_kwargs
    if record.ended_early is not None:
        exact["ended_early"] = record.ended_early
    row[EXACT_IDS_FIELD] = exact
    row["provenance"] = {
        "format": EXPORT_FORMAT,
        "range": provenance["range"],
        "sample_index": record.sample_index,
        **{k: v for k, v in provenance.items() if k != "range"},
        "answered_by": redact(record.engine) if record.engine else NOT_RECORDED,
    }
    return row


def exported_line(
    record: CompletionRecord, provenance: dict[str, Any], chat_template_kwargs: dict[str, Any]
) -> bytes:
    # Compact and UTF-8, as the store's records are written: json.loads gives back the same values.
    row = exported_row(record, provenance, chat_template_kwargs)
    text = json.dumps(row, ensure_ascii=False, separators=(",", ":"))
    return (text + "\n").encode()


@dataclass(frozen=True)
class _StoredRange:
    provenance: dict[str, Any]  # what every row of the range carries
    chat_template_kwargs: dict[str, Any]  # as tokenized_completions renders the range's answers
    dropped: dict[str, str]  # row -> reason, the rows target_completions left out


def _fetch(store: ObjectStore, key: str, local: Path) -> _StoredRange:
    """Download a committed range's `completions.jsonl` to `local`, and read what its rows carry. A range
    changed since its commit is refused, as any reader of it refuses it."""
    prefix = partition_prefix(ASSET, key)
    try:
        manifest = read_manifest(store, prefix)
    except (ManifestError, ValueError) as error:  # of another format, or not JSON: no reader takes it
        raise ExportError(f"{ASSET} range {key}'s manifest is unreadable: {error}") from None
    if manifest is None:  # deleted between the listing and now
        raise ExportError(f"{ASSET} range {key} is no longer committed in {store.uri(prefix)}")
    changed = changed_since_commit(store, prefix, manifest)
    if changed:
        raise ExportError(
            f"{ASSET} range {key} changed since it was committed ({next(iter(changed.values()))}): "
            f"materialise {ASSET} --partition {key} again before exporting it"
        )
    size = (manifest.get("objects") or {}).get(COMPLETIONS_NAME)
    if size is None:
        raise ExportError(f"{ASSET} range {key}'s manifest names no {COMPLETIONS_NAME} ({store.uri(prefix)})")
    store.download(f"{prefix}/{COMPLETIONS_NAME}", local, size=size)
    fingerprint = _fingerprint(store, prefix)
    # tokenized_completions reads the range's chat-template arguments from its manifest, unredacted.
    generation = manifest.get("generation") or fingerprint.get("generation") or {}
    return _StoredRange(
        provenance=_provenance(key, manifest, fingerprint),
        chat_template_kwargs=dict(generation.get("chat_template_kwargs") or {}),
        dropped=dict(manifest.get("dropped") or {}),
    )


def _fingerprint(store: ObjectStore, prefix: str) -> dict[str, Any]:
    try:
        value = json.loads(store.get_bytes(f"{prefix}/{FINGERPRINT_NAME}"))
    except (ObjectNotFound, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _provenance(key: str, manifest: dict[str, Any], fingerprint: dict[str, Any]) -> dict[str, Any]:
    """What a range's rows were made by and from: its manifest's fields, its fingerprint's where the
    manifest predates them; "not recorded" for what neither holds (ranges made before engines, or the
    dataset's rows, were recorded)."""

    def recorded(name: str) -> Any:
        value = manifest.get(name)
        return value if value is not None else fingerprint.get(name)

    target = str(recorded("target_model") or "")
    # The target's identity is `<directory name>@<digest of its config.json>`: the digest is its revision.
    model, _, revision = target.partition("@")
    provenance = {
        "range": key,
        "target_model": model or NOT_RECORDED,
        "target_revision": revision or NOT_RECORDED,
        "engine": recorded("engine") or NOT_RECORDED,
        "generation": recorded("generation") or {},
        "truncated_policy": manifest.get("truncated_policy") or fingerprint.get("truncated") or NOT_RECORDED,
        "dataset": fingerprint.get("dataset") or NOT_RECORDED,
    }
    return redact_value(provenance)  # a URL (the dataset's, a server's) never carries its password out


def _order(key: str) -> tuple[int, int, str]:
    try:
        sample_range = SampleRange.parse(key)
    except ValueError:
        return (-1, -1, key)
    return (sample_range.start, sample_range.end, key)


def _check_disjoint(keys: Sequence[str]) -> None:
    """Ranges of two partition sizes may both be stored; exporting both would give their rows twice."""
    previous: SampleRange | None = None  # of the ranges so far (in start order), the one ending last
    for key in keys:
        try:
            current = SampleRange.parse(key)
        except ValueError:
            continue
        if previous is not None and current.start <= previous.end:
            raise ExportError(
                f"{ASSET} ranges {previous.key} and {current.key} overlap (both are stored, made with two "
                "values of DFLASH_SAMPLES_PER_PARTITION): name the ranges to export"
            )
        if previous is None or current.end > previous.end:
            previous = current


def _ranges_text(keys: Sequence[str]) -> str:
    shown = ", ".join(keys[:_SHOWN_RANGES])
    return shown + (f" and {len(keys) - _SHOWN_RANGES} more" if len(keys) > _SHOWN_RANGES else "")
