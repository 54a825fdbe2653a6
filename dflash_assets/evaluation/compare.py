"""Runs side by side: every stored evaluation (`evaluations/<run>/<set>/evaluation.json`, committed) as
one table of runs × prompt sets, with what each drafter is and what it cost to train, as text, markdown
or JSON (`dflash-assets compare`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from dflash_assets.evaluation.runs import export_identity, read_evaluation
from dflash_assets.storage.layout import EVALUATION_NAME, EVALUATIONS_PREFIX
from dflash_assets.storage.store import ObjectStore

COLUMNS = (
    ("run", "run"),
    ("prompt_set", "set"),
    ("prompts", "prompts"),
    ("tau", "τ"),
    ("floor_tau", "floor τ"),
    ("ratio", "× floor"),
    ("lossless", "lossless"),
    ("drafter_arch", "drafter"),
    ("objective", "objective"),
    ("block_size", "block"),
    ("parameters", "parameters"),
    ("steps", "steps"),
    ("train_time", "training"),
    ("conversations", "conversations"),
    ("answer_tokens", "answer tokens"),
    ("note", "note"),
)


def stored_evaluations(store: ObjectStore, runs: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Every committed evaluation in the store (of `runs` only, when given), by run then set; an
    evaluation whose run was exported again since is marked `stale`."""
    records = []
    current: dict[str, str | None] = {}
    for info in store.list(f"{EVALUATIONS_PREFIX}/"):
        parts = info.key.split("/")
        if len(parts) != 4 or parts[3] != EVALUATION_NAME:
            continue
        run, prompt_set = parts[1], parts[2]
        if runs and run not in runs:
            continue
        record = read_evaluation(store, run, prompt_set)
        if record is None:
            continue  # written, not committed: a run that died before its manifest
        if run not in current:
            current[run] = export_identity(store, run)
        record["stale"] = (
            bool(record.get("export_identity")) and record.get("export_identity") != current[run]
        )
        records.append(record)
    return sorted(records, key=lambda r: (r["run"], r["prompt_set"] != "held_out", r["prompt_set"]))


def comparison_rows(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per evaluation: the figures and what the drafter is, plain values (the JSON output)."""
    rows = []
    for record in records:
        training = record.get("training") or {}
        loss = training.get("loss") or "?"
        distill = training.get("distill_weight")
        rows.append(
            {
                "run": record["run"],
                "prompt_set": record["prompt_set"],
                "reference": record.get("reference") or "",
                "prompts": record["prompts"],
                "max_new_tokens": record.get("max_new_tokens"),
                "tau": record.get("tau"),
                "floor_tau": record.get("floor_tau"),
                "ratio": record.get("ratio"),
                "lossless_prompts": record.get("lossless_prompts"),
                "floor_lossless_prompts": record.get("floor_lossless_prompts"),
                "drafter_arch": training.get("drafter_arch"),
                "objective": loss + (f" + KL {distill:g}" if distill else ""),
                "block_size": training.get("block_size"),
                "parameters": training.get("parameters"),
                "steps": training.get("steps"),
                # What the drafter trained on: τ against data size is read off these.
                "training_conversations": training.get("training_conversations"),
                "training_answer_tokens": training.get("training_answer_tokens"),
                "train_seconds": training.get("train_seconds"),
                "train_device_seconds": training.get("train_device_seconds"),
                "measured_at": record.get("measured_at"),
                "stale": bool(record.get("stale")),
            }
        )
    return rows


def _cells(row: dict[str, Any]) -> dict[str, str]:
    def number(value: Any, digits: int) -> str:
        return "—" if value is None else f"{value:.{digits}f}"

    seconds = row.get("train_seconds")
    parameters = row.get("parameters")
    return {
        "run": row["run"],
        "prompt_set": row["prompt_set"],
        "prompts": str(row["prompts"]),
        "tau": number(row["tau"], 3),
        "floor_tau": number(row["floor_tau"], 3),
        "ratio": number(row["ratio"], 2),
        "lossless": f"{row['lossless_prompts']}/{row['prompts']}",
        "drafter_arch": row.get("drafter_arch") or "?",
        "conversations": _count(row.get("training_conversations")),
        "answer_tokens": _count(row.get("training_answer_tokens")),
        "objective": row["objective"],
        "block_size": str(row.get("block_size") or "?"),
        "parameters": f"{parameters / 1e6:.1f} M" if parameters else "?",
        "steps": str(row.get("steps") if row.get("steps") is not None else "?"),
        "train_time": _duration(seconds) if seconds else "?",
        "note": "stale: exported again since" if row["stale"] else "",
    }


def _count(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


# `compare --by`: the order of the rows (a run's sets stay together, held_out first).
ORDERS = {
    "run": lambda row: (row["run"],),
    "conversations": lambda row: (row.get("training_conversations") or 0, row["run"]),
    "answer_tokens": lambda row: (row.get("training_answer_tokens") or 0, row["run"]),
}


def ordered(rows: Sequence[dict[str, Any]], by: str = "run") -> list[dict[str, Any]]:
    """The rows by run (their stored order), or by the conversations or answer tokens each run trained on,
    fewest first: τ against data size, read down the table."""
    key = ORDERS[by]
    return sorted(rows, key=lambda row: (*key(row), row["prompt_set"] != "held_out", row["prompt_set"]))


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def format_comparison(rows: Sequence[dict[str, Any]], how: str = "text") -> str:
    """The rows as `text` (aligned columns), `markdown` (a table) or `json`."""
    if how == "json":
        return json.dumps(list(rows), indent=1)
    if not rows:
        return "no stored evaluation: materialise drafter_evaluations first"
    # Columns no row fills are left out: the note without a stale row, the data size of runs trained before
    # drafter_checkpoints recorded it.
    sized = any(row.get("training_conversations") is not None for row in rows)
    shown = {"note": any(r["stale"] for r in rows), "conversations": sized, "answer_tokens": sized}
    columns = [(key, title) for key, title in COLUMNS if shown.get(key, True)]
    cells = [_cells(row) for row in rows]
    if how == "markdown":
        lines = ["| " + " | ".join(title for _, title in columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(c[key] for key, _ in columns) + " |" for c in cells]
        return "\n".join(lines)
    widths = {key: max(len(title), *(len(c[key]) for c in cells)) for key, title in columns}
    lines = ["  ".join(title.ljust(widths[key]) for key, title in columns).rstrip()]
    lines += ["  ".join(c[key].ljust(widths[key]) for key, _ in columns).rstrip() for c in cells]
    return "\n".join(lines)
