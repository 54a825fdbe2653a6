"""Runs side by side: every stored evaluation (`evaluations/<run>/<set>/evaluation.json`, committed) as
one table of runs × prompt sets, with what each drafter is and what it cost to train, as text, markdown
or JSON (`dflash-assets compare`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from dflash_assets.evaluation.runs import EVALUATION_NAME, EVALUATIONS_PREFIX, export_identity
from dflash_assets.storage.manifest import read_manifest
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
        if read_manifest(store, f"{EVALUATIONS_PREFIX}/{run}/{prompt_set}") is None:
            continue  # written, not committed: a run that died before its manifest
        record = json.loads(bytes(store.get_bytes(info.key)))
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
        "objective": row["objective"],
        "block_size": str(row.get("block_size") or "?"),
        "parameters": f"{parameters / 1e6:.1f} M" if parameters else "?",
        "steps": str(row.get("steps") if row.get("steps") is not None else "?"),
        "train_time": _duration(seconds) if seconds else "?",
        "note": "stale: exported again since" if row["stale"] else "",
    }


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
    columns = [(key, title) for key, title in COLUMNS if key != "note" or any(r["stale"] for r in rows)]
    cells = [_cells(row) for row in rows]
    if how == "markdown":
        lines = ["| " + " | ".join(title for _, title in columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(c[key] for key, _ in columns) + " |" for c in cells]
        return "\n".join(lines)
    widths = {key: max(len(title), *(len(c[key]) for c in cells)) for key, title in columns}
    lines = ["  ".join(title.ljust(widths[key]) for key, title in columns).rstrip()]
    lines += ["  ".join(c[key].ljust(widths[key]) for key, _ in columns).rstrip() for c in cells]
    return "\n".join(lines)
