"""Regenerating one sample range exactly once per turn across kills: every answer persisted as it
arrives, the engine asked again only for turns never answered.

Where an answer lives, in order:
1. `journal.jsonl` in the range's staging directory: one line per answered turn, appended (and flushed
   to the page cache) the moment it arrives, so a SIGKILL loses only the requests still in flight, and
   the conversation's whole record once its last turn is in; a rerun resumes a half-answered
   conversation at its next turn, against the answers it already has;
2. once a conversation is finished, a chunk of up to `chunk_records` conversations (or `chunk_every_s`
   seconds' worth), written atomically beside the journal and uploaded to `<prefix>/chunks/` through the
   bounded uploader (the journal then keeps only the turns of conversations still under way);
3. once every row is answered, `completions.jsonl`: every chunk merged in sample order, each row once,
   dropped rows included as `{"sample_index", "dropped", "detail"}` lines; the chunks are deleted after
   it is confirmed, and the manifest (written by the IO manager) commits the range.

A rerun reads `completions.jsonl` or the chunks from the store (one listing), uploads the chunks and
finished conversations left in staging, resumes the half-answered ones, and generates only what is in
none of them. The fingerprint (the target, the generation settings, and the dataset's rows the answers
are made from) keeps two of them from ever sharing a range, in the store or in staging.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import heapq
import json
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from dflash_assets.conversations.drops import SHOWN, BadRow, dropped_line
from dflash_assets.conversations.layouts import Conversation, Dropped
from dflash_assets.conversations.tokenize import check_bad_rows
from dflash_assets.generation.conversation import (
    ENDED_AT_MAX_LENGTH,
    ENDED_AT_TOOL_CALLS,
    Answer,
    Regeneration,
    plan_regeneration,
)
from dflash_assets.generation.engine import Engine, TurnScheduler
from dflash_assets.generation.records import (
    COMPLETIONS_FORMAT,
    CompletionRecord,
    DroppedRow,
    Line,
    chunk_name,
    is_chunk_name,
    parse_line,
    read_lines,
    write_lines,
)
from dflash_assets.generation.settings import GenerationSettings
from dflash_assets.storage.faults import fault_point
from dflash_assets.storage.fingerprint import claim_prefix, read_fingerprint
from dflash_assets.storage.layout import CHUNKS_DIR, COMPLETIONS_NAME, FINGERPRINT_NAME
from dflash_assets.storage.range_progress import RangeCounters, RangeProgress, eta_text
from dflash_assets.storage.staging import PartitionBusy, StagingDirectory, staging_lock
from dflash_assets.storage.store import ObjectStore, StoreError
from dflash_assets.storage.units import human_duration
from dflash_assets.storage.uploader import Uploader

__all__ = ["PartitionBusy", "RegenerationProgress", "RegenerationResult", "regenerate_range"]

JOURNAL_NAME = "journal.jsonl"
TRUNCATED_POLICIES = ("keep", "drop")


class OtherEngineAnswers(ValueError):
    """The range's stored answers were made by another engine or dtype: continuing would mix the two."""


def refuse_other_engine(stored: dict[str, Any] | None, fingerprint: dict[str, Any], where: str) -> None:
    """Answers are the most expensive thing the platform makes: a range whose stored answers differ from
    this run's only by the engine (or its dtype) is neither mixed with nor replaced by this run's."""
    if not isinstance(stored, dict) or "engine" not in stored or "engine" not in fingerprint:
        return
    theirs = {k: v for k, v in stored["engine"].items() if k != "version"}
    ours = {k: v for k, v in fingerprint["engine"].items() if k != "version"}
    rest = {k: v for k, v in stored.items() if k != "engine"}
    if theirs == ours or rest != {k: v for k, v in fingerprint.items() if k != "engine"}:
        return  # the same engine, or another fingerprint altogether (claim_prefix's to handle)
    raise OtherEngineAnswers(
        f"{where} holds answers made by {_engine_text(stored['engine'])}; this run answers with "
        f"{_engine_text(fingerprint['engine'])}, and the two are never mixed. Continue it with "
        "DFLASH_GENERATE_ENGINE (and DFLASH_GENERATE_DTYPE) as it was made, or delete that prefix to "
        "regenerate the range with this engine"
    )


class RegenerationIncomplete(StoreError):
    """After every upload was confirmed, the store still lacks rows this range needs."""


def completions_fingerprint(
    target_model: str,
    settings: GenerationSettings,
    truncated: str = "keep",
    *,
    dataset: dict[str, str] | None = None,
    engine: dict[str, str] | None = None,
) -> dict[str, Any]:
    """What must be equal for two answers to belong to the same range: the target, the generation
    settings, what the answers were made from (`dataset`: see `dataset_identity`) and the engine that made
    them (`engine`: its name and dtype, e.g. `{"name": "vllm", "version": "0.32.0", "dtype": "float32"}`;
    the version is recorded, never compared)."""
    fingerprint: dict[str, Any] = {
        "format": COMPLETIONS_FORMAT,
        "target_model": target_model,
        "generation": settings.fingerprint(),
        "truncated": truncated,
    }
    if dataset is not None:
        fingerprint["dataset"] = dict(dataset)
    if engine is not None:
        fingerprint["engine"] = dict(engine)
    return fingerprint


def dataset_identity(uri: str, rows: Sequence[tuple[int, Any]]) -> dict[str, str]:
    """The rows a range's answers are made from: where they were read and a digest of their content
    (index and messages, with the tools of a row that has them, or why a row is unreadable), so answers
    staged for another dataset, or for rows that changed since, are never taken for this range's."""
    digest = hashlib.sha256()
    for index, row in rows:
        if isinstance(row, Dropped):
            body: Any = {"dropped": row.reason}
        else:
            body = row.identity() if isinstance(row, Conversation) else row
        digest.update(json.dumps([index, body], sort_keys=True, ensure_ascii=False, default=str).encode())
        digest.update(b"\n")
    return {"uri": str(uri), "rows_sha256": digest.hexdigest()}


def _same_answers(fingerprint: dict[str, Any]) -> Callable[[dict[str, Any]], bool]:
    """Which stored fingerprints made answers this range can keep: the same one found elsewhere (a dataset
    moved: same rows, another path), or one an earlier version wrote before fingerprints named the
    dataset (such a store's answers were made for it; the store itself is this pipeline's), before
    conversations were bounded by `max_conversation_tokens` (every turn answered) or bounded by a larger
    one (a longer DFLASH_MAX_LENGTH: every turn asked now was answered)."""

    def without_uri(value: dict[str, Any]) -> dict[str, Any]:
        dataset = {k: v for k, v in (value.get("dataset") or {}).items() if k != "uri"}
        return {**value, "dataset": dataset}

    def without_budget(value: dict[str, Any]) -> dict[str, Any]:
        generation = {
            k: v for k, v in (value.get("generation") or {}).items() if k != "max_conversation_tokens"
        }
        return {**value, "generation": generation}

    ours_bound = (fingerprint.get("generation") or {}).get("max_conversation_tokens")

    def comparable(value: dict[str, Any], stored_names_engine: bool) -> dict[str, Any]:
        """An engine's version is provenance (a vLLM upgrade makes the same answers), never compared.
        Answers stored before engines were recorded name none: they are kept whatever engine asks now."""
        if not stored_names_engine:
            return {k: v for k, v in value.items() if k != "engine"}
        engine = {k: v for k, v in (value.get("engine") or {}).items() if k != "version"}
        return {**value, "engine": engine}

    def same(stored: dict[str, Any]) -> bool:
        named = "engine" in stored
        return _same(comparable(stored, named), comparable(fingerprint, named))

    def _same(stored: dict[str, Any], fingerprint: dict[str, Any]) -> bool:
        ours = fingerprint
        # Answered before conversations were bounded, or to a longer bound: every turn asked now is there.
        bound = (stored.get("generation") or {}).get("max_conversation_tokens")
        if bound is None or (ours_bound is not None and bound >= ours_bound):
            ours, stored = without_budget(fingerprint), without_budget(stored)
        if "dataset" not in stored:
            return stored == {k: v for k, v in ours.items() if k != "dataset"}
        return without_uri(stored) == without_uri(ours)

    return same


@dataclass(frozen=True, kw_only=True)
class RegenerationProgress(RangeProgress):
    """A snapshot handed to `on_progress`: conversations and tokens done, rates, ETA, server health.
    `samples_total` counts the range's conversations to answer (rows dropped on reading excluded)."""

    unit: ClassVar[str] = "conversations"

    engine: str
    generated_this_run: int
    tokens_this_run: int
    requests: int
    retries: int
    server_errors: int
    in_flight: int
    tokens_in_flight: int = 0  # new tokens of turns under way, where the engine sees them

    @property
    def done_this_run(self) -> int:
        return self.generated_this_run

    def status_figures(self) -> str:
        figures = f"{self.tokens_per_s:,.0f} tokens/s · {self.requests} requests"
        return figures + (f" · {self.retries} retries" if self.retries else "")


@dataclass
class RegenerationResult:
    objects: dict[str, int]  # object name -> size: the range's `completions.jsonl`
    rows: int  # rows of the range present in the dataset
    records: int  # conversations answered and kept
    dropped: dict[int, str]  # sample index -> reason (unreadable, failed, truncated with truncated=drop)
    truncated: int  # kept records with an answer cut at max_new_tokens
    tool_call_turns: int  # answers of kept records that called tools
    ended_at_tool_calls: int  # kept records cut at a turn whose tool calls differ from the dataset's
    ended_at_max_length: int  # kept records cut at the answer that reached the token budget
    generated_now: int
    reused_from_store: int
    reused_from_staging: int
    tokens_generated: int  # answer tokens over every kept record
    tokens_generated_now: int
    requests: int
    retries: int
    server_errors: int
    prompt_token_mismatches: int
    duration_s: float
    tokens_per_s: float  # this run's generation rate
    engine: str
    fingerprint: dict[str, Any] = field(default_factory=dict)
    sample_indices: list[int] = field(default_factory=list)  # the rows kept, in order
    bad_rows: list[BadRow] = field(default_factory=list)  # the first `drops.SHOWN` dropped rows, in order

    @property
    def dropped_by_reason(self) -> dict[str, int]:
        return dict(sorted(Counter(self.dropped.values()).items()))

    def dropped_line(self) -> str:
        """The dropped rows in one line: how many, by reason, and the first few with what was wrong."""
        return dropped_line(self.rows, self.dropped_by_reason, self.bad_rows)

    def metadata(self) -> dict[str, Any]:
        """What the run reports about the range: numbers a UI plots across ranges, and the settings."""
        return {
            "conversations": self.records,
            "rows": self.rows,
            "dropped": len(self.dropped),
            **{f"dropped_{reason}": count for reason, count in self.dropped_by_reason.items()},
            "truncated": self.truncated,
            "tool_call_turns": self.tool_call_turns,
            "ended_at_tool_calls": self.ended_at_tool_calls,
            "ended_at_max_length": self.ended_at_max_length,
            "tokens_generated": self.tokens_generated,
            "generated_now": self.generated_now,
            "reused_from_store": self.reused_from_store,
            "reused_from_staging": self.reused_from_staging,
            "tokens_per_s": float(self.tokens_per_s),
            "requests": self.requests,
            "retries": self.retries,
            "server_errors": self.server_errors,
            "prompt_token_mismatches": self.prompt_token_mismatches,
            "engine": self.engine or "none (every row was already answered)",
            "answered_by": _engine_text(self.fingerprint.get("engine")),
            "duration": human_duration(self.duration_s),
            "generation": self.fingerprint.get("generation", {}),
        }

    def manifest_fields(self) -> dict[str, Any]:
        """What the range's manifest records beside its objects."""
        return {
            "sample_indices": list(self.sample_indices),
            "dropped": {str(index): reason for index, reason in sorted(self.dropped.items())},
            "target_model": self.fingerprint.get("target_model"),
            "generation": self.fingerprint.get("generation"),
            "engine": self.fingerprint.get("engine"),
            "truncated_policy": self.fingerprint.get("truncated"),
            "conversations": self.records,
            "truncated": self.truncated,
            "ended_at_max_length": self.ended_at_max_length,
            "tokens_generated": self.tokens_generated,
        }

    def summary(self) -> str:
        return (
            f"{self.records} conversations answered by {self.fingerprint.get('target_model')} in "
            f"{human_duration(self.duration_s)} ({self.generated_now} generated now, "
            f"{self.reused_from_store} already in the store, {self.reused_from_staging} recovered from local "
            "staging)"
            + (
                f"; {self.ended_at_max_length} ended at the token budget (DFLASH_MAX_LENGTH)"
                if self.ended_at_max_length
                else ""
            )
        )


def _staged_fingerprint(staging_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((staging_dir / FINGERPRINT_NAME).read_text())
    except (OSError, ValueError):
        return None


def _engine_text(engine: dict[str, str] | None) -> str:
    """`vllm 0.32.0 (cpu) float32`: the engine a range's answers are made by, as its metadata says it."""
    if not engine:
        return "not recorded"
    build = f" ({engine['build']})" if engine.get("build") else ""
    parts = [engine.get("name", "?") + (f" {engine['version']}" if engine.get("version") else "") + build]
    if engine.get("dtype"):
        parts.append(engine["dtype"])
    return " ".join(parts)


def regenerate_range(
    *,
    rows: Sequence[tuple[int, Any]],
    open_engine: Callable[[], contextlib.AbstractContextManager[Engine]],
    store: ObjectStore,
    prefix: str,
    staging_dir: Path,
    uploader: Uploader,
    fingerprint: dict[str, Any],
    truncated: str = "keep",
    max_bad_fraction: float = 0.5,
    dataset_name: str = "the dataset",
    log: Callable[[str], None] = print,
    warn: Callable[[str], None] | None = None,
    progress_every_s: float = 15.0,
    on_progress: Callable[[RegenerationProgress], None] | None = None,
    chunk_records: int = 256,
    chunk_every_s: float = 30.0,
    token_budget: int | None = None,
    locate: Callable[[int], str] | None = None,
) -> RegenerationResult:
    """Make `<prefix>/completions.jsonl` hold every row of `rows` (`(index, messages or Dropped)`, as
    `datasets.iter_rows` yields them), generating only what neither the store nor staging holds.

    `open_engine()` is entered only when something is left to generate (no device is leased and no
    model loaded for a range already done). Raises `TooManyBadRows` when more than `max_bad_fraction`
    of the rows were dropped, after everything is stored. `token_budget` ends a conversation once an
    answer reaches that many tokens of it: the `max_conversation_tokens` of the settings `fingerprint`
    was made from, so answers bounded by one budget are never stored as another's. `locate(index)` says
    where a dropped row is in the dataset ("line 8"; default "row <index>").
    """
    if truncated not in TRUNCATED_POLICIES:
        raise ValueError(f"truncated={truncated!r} must be one of {TRUNCATED_POLICIES}")
    fingerprinted = (fingerprint.get("generation") or {}).get("max_conversation_tokens")
    if token_budget != fingerprinted:
        raise ValueError(
            f"token_budget={token_budget} but the fingerprint's settings say max_conversation_tokens="
            f"{fingerprinted}: pass the settings' own max_conversation_tokens (DFLASH_MAX_LENGTH)"
        )
    started = time.monotonic()
    warn = warn or (lambda message: log(f"WARNING: {message}"))
    base = prefix.strip("/") + "/"
    where = store.uri(base.rstrip("/"))
    staging_dir = Path(staging_dir)
    staging_dir.mkdir(parents=True, exist_ok=True)

    planned: list[Regeneration] = []
    unreadable: dict[int, Dropped] = {}
    for index, row in rows:
        plan = plan_regeneration(index, row, token_budget)
        if isinstance(plan, Dropped):
            unreadable[index] = plan
        else:
            planned.append(plan)
    all_rows = {c.sample_index for c in planned} | set(unreadable)

    with staging_lock(staging_dir):
        staging = StagingDirectory(staging_dir, fingerprint)
        refuse_other_engine(read_fingerprint(store, base), fingerprint, where)
        refuse_other_engine(_staged_fingerprint(staging_dir), fingerprint, f"staging {staging_dir}")
        listed = claim_prefix(store, base, fingerprint, warn, equivalent=_same_answers(fingerprint))
        staging.reconcile(warn)
        in_store = _indices_in_store(store, base, listed)
        journal = _Journal(staging_dir, base, uploader, chunk_records, chunk_every_s, truncated)
        planned_by_index = {c.sample_index: c for c in planned}
        in_staging, answered = journal.recover(in_store, planned_by_index, warn)
        in_staging -= in_store
        done = in_store | in_staging
        missing = [c for c in planned if c.sample_index not in done]
        for conversation in missing:  # half-answered before a kill: resume at the next turn
            conversation.answers = list(answered.get(conversation.sample_index, []))
        resumed = sum(1 for c in missing if c.answers)
        log(
            f"{where}: {len(all_rows)} rows ({len(unreadable)} unreadable); {len(in_store)} answered in the "
            f"store, {len(in_staging)} in local staging (uploading), {len(missing)} to generate"
            + (
                f" ({resumed} of them resumed after {sum(len(c.answers) for c in missing)} turns answered "
                "before)"
                if resumed
                else ""
            )
        )
        counters = _Counters(len(planned), uploader, log, progress_every_s, on_progress)
        counters.start(len(missing))
        engine_name, stats, mismatches = "", None, 0
        answering_started = time.monotonic()
        try:
            if missing:
                with open_engine() as engine:
                    # Rates count from the first request: a server's start or a model's load is not answering.
                    counters.start(len(missing))
                    answering_started = time.monotonic()
                    engine_name, counters.engine = engine.name, engine
                    described = getattr(engine, "description", engine.name)
                    log(f"{where}: generating {len(missing)} conversations with {described}")
                    scheduler = TurnScheduler(
                        missing,
                        on_answered=lambda c, turn, answer: journal.answered(c, turn, answer, engine.name),
                        on_finished=lambda c: counters.finished(journal.finished(c, engine.name)),
                        on_dropped=lambda c, dropped: counters.finished(journal.dropped(c, dropped)),
                    )

                    def tick() -> None:
                        journal.seal(force=False)
                        counters.maybe_report()

                    try:
                        engine.run(scheduler, tick)
                    finally:
                        journal.seal(force=True)  # what finished before a failure is kept either way
                    stats, mismatches = engine.stats, getattr(engine, "prompt_token_mismatches", 0)
        finally:
            journal.close()
        journal.seal(force=True)
        counters.wait_for_uploads()
        generate_seconds = time.monotonic() - answering_started

        final = staging_dir / COMPLETIONS_NAME
        summary = _assemble(store, base, final, unreadable, all_rows, staging_dir)
        if summary.chunk_keys or listed.get(COMPLETIONS_NAME) != final.stat().st_size:
            uploader.submit(final, base + COMPLETIONS_NAME)
            uploader.flush()
        else:  # the stored object already holds every row, as merged now: a rerun rewrites nothing
            final.unlink(missing_ok=True)
        size = store.head(base + COMPLETIONS_NAME)
        if size is None:
            raise RegenerationIncomplete(
                f"{where}/{COMPLETIONS_NAME} is missing after its upload was confirmed"
            )
        for key in summary.chunk_keys:  # the merged object holds every row now
            store.delete(key)
        counters.report("done")

    result = RegenerationResult(
        objects={COMPLETIONS_NAME: size.size},
        rows=len(all_rows),
        records=summary.records,
        dropped=summary.dropped,
        truncated=summary.truncated,
        tool_call_turns=summary.tool_call_turns,
        ended_at_tool_calls=summary.ended_at_tool_calls,
        ended_at_max_length=summary.ended_at_max_length,
        generated_now=counters.done_this_run,
        reused_from_store=len(in_store),
        reused_from_staging=len(in_staging),
        tokens_generated=summary.tokens,
        tokens_generated_now=counters.tokens_this_run,
        requests=stats.requests if stats else 0,
        retries=stats.retries if stats else 0,
        server_errors=stats.server_errors if stats else 0,
        prompt_token_mismatches=mismatches,
        duration_s=time.monotonic() - started,
        tokens_per_s=counters.tokens_this_run / generate_seconds if counters.tokens_this_run else 0.0,
        engine=engine_name,
        fingerprint=fingerprint,
        sample_indices=sorted(all_rows - set(summary.dropped)),
    )
    log(
        f"{where}: done: {result.records} conversations ({result.truncated} truncated), "
        f"{len(result.dropped)} dropped {result.dropped_by_reason}; {result.generated_now} generated now, "
        f"{result.reused_from_store} from the store, {result.reused_from_staging} from staging; "
        f"{result.tokens_generated_now:,} tokens at {result.tokens_per_s:,.0f} tokens/s; "
        f"{result.requests} requests, {result.retries} retries"
    )
    locate = locate or (lambda index: f"row {index}")
    result.bad_rows = [
        BadRow(dataset_name, index, locate(index), dropped.reason, dropped.detail)
        for index, dropped in sorted(summary.first_dropped.items())
    ]
    first_bad = result.bad_rows[0] if result.bad_rows else None
    check_bad_rows(
        result.rows,
        result.dropped,
        max_bad_fraction,
        where=f"of {where}",
        first_bad=first_bad,
        advice="Every answer is stored: fix the cause (or raise max_bad_fraction) and rerun.",
    )
    return result


# ------------------------------------------------------------------------------ what is already done


def _indices_in_store(store: ObjectStore, base: str, listed: dict[str, int]) -> set[int]:
    """Rows answered in the store: those of `completions.jsonl` and of every chunk."""
    done: set[int] = set()
    names = [name for name in listed if name == COMPLETIONS_NAME or _is_chunk_key(name)]
    for name in names:
        for line in _object_lines(store, base + name):
            done.add(line.sample_index)
    return done


def _is_chunk_key(name: str) -> bool:
    folder, _, leaf = name.partition("/")
    return folder == CHUNKS_DIR and is_chunk_name(leaf)


def _object_lines(store: ObjectStore, key: str) -> Iterator[Line]:
    text = store.get_bytes(key).decode()
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            yield parse_line(line, f"{store.uri(key)} line {number}")


class _Journal:
    """Answered turns, appended as they arrive; finished conversations sealed into chunks for upload."""

    def __init__(
        self,
        staging_dir: Path,
        base: str,
        uploader: Uploader,
        chunk_records: int,
        chunk_every_s: float,
        truncated: str,
    ) -> None:
        self.staging_dir, self.base, self.uploader = staging_dir, base, uploader
        self.chunk_records, self.chunk_every_s, self.truncated = (
            max(1, chunk_records),
            chunk_every_s,
            truncated,
        )
        self.path = staging_dir / JOURNAL_NAME
        self._lock = threading.Lock()
        self._finished: list[Line] = []  # finished or dropped conversations not sealed into a chunk yet
        self._under_way: dict[int, list[str]] = {}  # sample -> journal lines of its answered turns
        self._handle: Any = None
        self._last_seal = time.monotonic()

    def recover(
        self, in_store: set[int], planned: dict[int, Regeneration], warn: Callable[[str], None]
    ) -> tuple[set[int], dict[int, list[Answer]]]:
        """Upload the chunks an earlier run left in staging and seal the conversations its journal
        finished; returns the rows they hold and, per half-answered conversation, its answers so far."""
        recovered: set[int] = set()
        for path in sorted(self.staging_dir.iterdir()):
            if not (path.is_file() and is_chunk_name(path.name)):
                continue
            try:
                lines = read_lines(path)
            except ValueError as error:
                warn(f"staged {path.name} is unusable ({error}); its rows are generated again")
                path.unlink(missing_ok=True)
                continue
            rows = {line.sample_index for line in lines}
            if rows <= in_store:  # uploaded just before the crash, not yet deleted here
                path.unlink(missing_ok=True)
                continue
            recovered |= rows
            self.uploader.submit(path, f"{self.base}{CHUNKS_DIR}/{path.name}")
        answered: dict[int, list[Answer]] = {}
        engines: dict[int, str] = {}  # sample -> the engine of its last answered turn
        if self.path.exists():
            done = in_store | recovered
            for index, entry in self._read_journal(warn):
                if index in done or index not in planned:
                    continue
                if isinstance(entry, DroppedRow | CompletionRecord):  # a conversation's whole record
                    self._finished.append(entry)
                    done.add(index)
                    answered.pop(index, None)
                    self._under_way.pop(index, None)
                    continue
                turn, answer, engines[index], text = entry
                answers = answered.setdefault(index, [])
                if turn != len(answers) or self._resumed(planned[index], answers).finished:
                    continue  # not the next turn of this conversation: the journal never holds such a line
                answers.append(answer)
                self._under_way.setdefault(index, []).append(text)
            for index in sorted(answered):
                resumed = self._resumed(planned[index], answered[index])
                if resumed.finished:
                    answered.pop(index)
                    self._finished.append(self._record(resumed, engines[index]))
                    del self._under_way[index]
            recovered |= {line.sample_index for line in self._finished}
            with self._lock:
                if self._finished:
                    self._seal_locked()
                else:
                    self._rewrite_journal_locked()
        return recovered, answered

    @staticmethod
    def _resumed(planned: Regeneration, answers: list[Answer]) -> Regeneration:
        # Everything the plan holds (tools, token budget) decides where it ends: a resumed conversation
        # must end at the turn the uninterrupted one would have.
        return dataclasses.replace(planned, answers=list(answers))

    def _read_journal(self, warn: Callable[[str], None]) -> Iterator[tuple[int, Any]]:
        """`(sample, a record (CompletionRecord or DroppedRow) or (turn, Answer, engine, the line))` for
        every complete line; a last line cut short by a kill was never acknowledged and is left out."""
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        lines.pop()  # after the last newline: b"" for a complete file, else a torn write
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode()
                body = json.loads(text)
                index = int(body["sample_index"])
                if "turn" not in body:
                    entry: Any = parse_line(text, f"{JOURNAL_NAME} line {number}")
                else:
                    entry = (int(body["turn"]), Answer(**body["answer"]), str(body.get("engine", "")), text)
            except (ValueError, KeyError, TypeError) as error:
                warn(f"staged {JOURNAL_NAME} line {number} is unusable ({error}); its turn is asked again")
                continue
            yield index, entry

    def answered(self, conversation: Regeneration, turn: int, answer: Answer, engine: str) -> None:
        """One answered turn, journaled before the conversation's next turn is asked for."""
        line = _turn_line(conversation.sample_index, turn, answer, engine)
        with self._lock:
            self._append_locked(line)
            self._under_way.setdefault(conversation.sample_index, []).append(line)
            fault_point("regenerate_journal")  # crash tests: die with this turn journaled

    def finished(self, conversation: Regeneration, engine: str) -> Line:
        return self._close(conversation.sample_index, self._record(conversation, engine))

    def dropped(self, conversation: Regeneration, dropped: Dropped) -> Line:
        return self._close(conversation.sample_index, DroppedRow(conversation.sample_index, dropped))

    def _record(self, conversation: Regeneration, engine: str) -> Line:
        line: Line = CompletionRecord.from_regeneration(conversation, engine)
        if self.truncated == "drop" and line.truncated:
            cut = [t["message"] for t in line.turns if t["finish_reason"] == "length"]
            line = DroppedRow(
                line.sample_index, Dropped("truncated_answer", f"messages {cut} hit max_new_tokens")
            )
        return line

    def _close(self, index: int, line: Line) -> Line:
        """A finished (or dropped) conversation: its whole record journaled, then counted for a chunk."""
        with self._lock:
            self._append_locked(line.to_json())
            self._under_way.pop(index, None)
            self._finished.append(line)
            if len(self._finished) >= self.chunk_records:
                self._seal_locked()
        return line

    def _append_locked(self, text: str) -> None:
        if self._handle is None:
            self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - open across appends
        # One write of one whole line, flushed: in the page cache, it outlives a SIGKILL.
        self._handle.write(text + "\n")
        self._handle.flush()

    def seal(self, *, force: bool) -> None:
        with self._lock:
            if self._finished and (force or time.monotonic() - self._last_seal >= self.chunk_every_s):
                self._seal_locked()

    def _seal_locked(self) -> None:
        lines = sorted(self._finished, key=lambda line: line.sample_index)
        path = self.staging_dir / chunk_name(lines)
        write_lines(path, lines)  # complete under its final name, or absent
        # The finished conversations are in the chunk now; the journal keeps the turns of those still
        # under way. A kill between the two writes leaves both, and the rerun takes the chunk's rows.
        self._rewrite_journal_locked()
        self._finished = []
        self._last_seal = time.monotonic()
        self.uploader.submit(path, f"{self.base}{CHUNKS_DIR}/{path.name}")

    def _rewrite_journal_locked(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        kept = [line for index in sorted(self._under_way) for line in self._under_way[index]]
        if not kept:
            self.path.unlink(missing_ok=True)
            return
        partial = self.path.with_name(f".{self.path.name}.partial")
        partial.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        partial.replace(self.path)  # the old journal or the new one, whole, whatever kills us

    def close(self) -> None:
        with self._lock:
            if self._handle is not None:
                self._handle.close()
                self._handle = None


def _turn_line(index: int, turn: int, answer: Answer, engine: str) -> str:
    body = {key: value for key, value in dataclasses.asdict(answer).items() if value is not None}
    return json.dumps(
        {"sample_index": index, "turn": turn, "engine": engine, "answer": body},
        ensure_ascii=False,
        separators=(",", ":"),
    )


# ------------------------------------------------------------------------------ the merged object


@dataclass
class _Summary:
    records: int = 0
    truncated: int = 0
    tool_call_turns: int = 0
    ended_at_tool_calls: int = 0
    ended_at_max_length: int = 0
    tokens: int = 0
    dropped: dict[int, str] = field(default_factory=dict)
    first_dropped: dict[int, Dropped] = field(default_factory=dict)  # the first `drops.SHOWN`, in order
    chunk_keys: list[str] = field(default_factory=list)


def _assemble(
    store: ObjectStore,
    base: str,
    final: Path,
    unreadable: dict[int, Dropped],
    all_rows: set[int],
    staging_dir: Path,
) -> _Summary:
    """Merge `completions.jsonl` (if any) and every chunk in the store into `final`, in sample order,
    each row once; every row of the range must be there."""
    summary = _Summary()
    listed = {info.key[len(base) :]: info.size for info in store.list(base)}
    sources = [name for name in listed if name == COMPLETIONS_NAME or _is_chunk_key(name)]
    summary.chunk_keys = [base + name for name in sources if name != COMPLETIONS_NAME]
    read_dir = staging_dir / ".merge"
    shutil.rmtree(read_dir, ignore_errors=True)
    read_dir.mkdir()
    try:
        files = []
        for number, name in enumerate(sources):
            local = read_dir / f"{number}.jsonl"
            store.download(base + name, local)
            files.append(local)
        unreadable_lines = [DroppedRow(i, d) for i, d in sorted(unreadable.items())]
        streams = [_stream(path) for path in files] + [iter(unreadable_lines)]
        merged = heapq.merge(*streams, key=lambda line: line.sample_index)

        def unique() -> Iterator[Line]:
            seen: set[int] = set()
            for line in merged:
                if line.sample_index in seen or line.sample_index not in all_rows:
                    continue
                seen.add(line.sample_index)
                if isinstance(line, DroppedRow):
                    summary.dropped[line.sample_index] = line.dropped.reason
                    if len(summary.first_dropped) < SHOWN:  # merged in sample order: these are the first
                        summary.first_dropped[line.sample_index] = line.dropped
                else:
                    summary.records += 1
                    summary.truncated += line.truncated
                    summary.tool_call_turns += line.tool_call_turns
                    summary.ended_at_tool_calls += line.ended_early == ENDED_AT_TOOL_CALLS
                    summary.ended_at_max_length += line.ended_early == ENDED_AT_MAX_LENGTH
                    summary.tokens += line.generated_tokens
                yield line
            missing = sorted(all_rows - seen)
            if missing:
                raise RegenerationIncomplete(
                    f"{len(missing)} rows of {store.uri(base.rstrip('/'))} are in no stored chunk after "
                    f"every upload was confirmed (first: row {missing[0]}); something else deleted them. "
                    "Rerun the range: stored answers are kept and only the gaps are generated"
                )

        write_lines(final, unique())
    finally:
        shutil.rmtree(read_dir, ignore_errors=True)
    return summary


def _stream(path: Path) -> Iterator[Line]:
    """A stored file's lines, one at a time (chunks and the merged object are written in sample order)."""
    with open(path, encoding="utf-8") as handle:
        for number, text in enumerate(handle, start=1):
            if text.strip():
                yield parse_line(text, f"{path.name} line {number}")


# ------------------------------------------------------------------------------------------ progress


class _Counters(RangeCounters[RegenerationProgress]):
    """This run's counters (`storage/range_progress.py`) with the engine's figures."""

    engine: Engine | None = None

    def finished(self, line: Line) -> None:
        self.count(1, line.generated_tokens if isinstance(line, CompletionRecord) else 0)

    def snapshot(self, reason: str | None = None) -> RegenerationProgress:
        figures = self.range_figures(reason)
        stats = self.engine.stats if self.engine is not None else None
        if stats is not None and stats.tokens_in_flight and figures["tokens_per_s"] is not None:
            # The engine's rate, answers under way included: long answers finish all at once, and a rate
            # of finished conversations alone reads near zero until they do.
            elapsed = max(time.monotonic() - self._started, 1e-9)
            figures["tokens_per_s"] += stats.tokens_in_flight / elapsed
        return RegenerationProgress(
            **figures,
            engine=self.engine.name if self.engine is not None else "",
            generated_this_run=figures["samples_done"] - self.already_done,
            tokens_this_run=self.tokens_this_run,
            requests=stats.requests if stats else 0,
            retries=stats.retries if stats else 0,
            server_errors=stats.server_errors if stats else 0,
            in_flight=stats.in_flight if stats else 0,
            tokens_in_flight=stats.tokens_in_flight if stats else 0,
        )

    def line(self, p: RegenerationProgress) -> str:
        if p.generated_this_run == 0 and p.samples_done < p.samples_total and self.engine is not None:
            # Nothing finished yet (a batch of long prompts answers all at once): a heartbeat, not silence.
            elapsed = time.monotonic() - self._started
            live = getattr(self.engine, "counts_tokens_live", False)
            return (
                f"generation: working, no conversation finished yet ({elapsed:.0f} s): "
                + (f"{p.tokens_in_flight:,} tokens generated so far, " if live else "")
                + f"{p.in_flight} rows in flight, "
                f"{p.requests} requests sent, engine {self.engine.name} | uploads in flight "
                f"{p.uploads_in_flight}"
            )
        under_way = f", {p.tokens_in_flight:,} tokens of answers under way" if p.tokens_in_flight else ""
        return (
            f"generation: {p.samples_done}/{p.samples_total} conversations "
            f"({p.generated_this_run} this run) | "
            f"{p.tokens_per_s:,.0f} tokens/s, {p.samples_per_s:.2f} conversations/s{under_way} | "
            f"ETA {eta_text(p)} | "
            f"{p.requests} requests, {p.in_flight} in flight, {p.retries} retries, {p.server_errors} server "
            f"errors | uploads in flight {p.uploads_in_flight}"
        )
