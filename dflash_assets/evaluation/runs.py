"""What the store holds of a training run that an evaluation reads: the run's manifest, its export, its
held-out samples (the tokenized rows training set aside), and the evaluations committed of it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.conversations.shard import load_shard
from dflash_assets.storage.layout import (
    CHECKPOINTS_PREFIX,
    DRAFTER_PREFIX,
    EVALUATION_NAME,
    REFERENCES_PREFIX,
    TOKENIZED_PREFIX,
    WEIGHTS_NAME,
    evaluation_prefix,
)
from dflash_assets.storage.manifest import StoredPartition, keep_only_version, read_manifest
from dflash_assets.storage.store import ObjectStore


class RunNotTrained(FileNotFoundError):
    """The run has no committed training in the store: one line naming it and what to materialise."""


def run_manifest(store: ObjectStore, run: str) -> dict[str, Any]:
    """`checkpoints/<run>/_manifest.json`: what `drafter_checkpoints` committed for the run."""
    manifest = read_manifest(store, f"{CHECKPOINTS_PREFIX}/{run}")
    if manifest is None:
        raise RunNotTrained(
            f"training run {run!r} is not in {store.uri(CHECKPOINTS_PREFIX)}: materialise "
            "drafter_checkpoints with DFLASH_RUN_NAME (run config run_name) set to it first, or name a run "
            "that is there"
        )
    return manifest


def read_evaluation(store: ObjectStore, run: str, prompt_set: str) -> dict[str, Any] | None:
    """The run's evaluation on one prompt set as `drafter_evaluations` committed it
    (`evaluations/<run>/<set>/evaluation.json`), or None where none is committed: one written by a step
    that died before its manifest is not read."""
    prefix = evaluation_prefix(run, prompt_set)
    if read_manifest(store, prefix) is None:
        return None
    return json.loads(bytes(store.get_bytes(f"{prefix}/{EVALUATION_NAME}")))


def read_reference(store: ObjectStore, identity: str) -> dict[str, Any] | None:
    """A prompt set's stored reference (`evaluation-references/<identity>.json`: the target's greedy output
    and prompt lookup's figures, `measure.reference_identity`), or None where none is stored or it does not
    read whole (then it is made again)."""
    from dflash_assets.storage.store import ObjectNotFound

    try:
        reference = json.loads(bytes(store.get_bytes(f"{REFERENCES_PREFIX}/{identity}.json")))
    except (ObjectNotFound, ValueError):
        return None
    return reference if isinstance(reference, dict) and isinstance(reference.get("greedy"), list) else None


def write_reference(store: ObjectStore, identity: str, reference: dict[str, Any]) -> None:
    """Keep a prompt set's reference for the next evaluation of the same identity (one object, written
    whole: it depends on its identity alone, so a step that dies after writing it leaves nothing wrong)."""
    store.put_bytes(f"{REFERENCES_PREFIX}/{identity}.json", json.dumps(reference).encode())


def export_identity(store: ObjectStore, run: str) -> str | None:
    """The export's weights as the store identifies them (their checksum or ETag): an evaluation records it,
    so a later export of the same run is seen not to be what was measured."""
    prefix = f"{DRAFTER_PREFIX}/{run}/"
    for info in store.list(prefix):
        if info.key == prefix + WEIGHTS_NAME:
            return store.checksum(info) or info.etag or f"{info.size} bytes"
    return None


def download_export(store: ObjectStore, run: str, directory: Path) -> Path:
    """The run's export (`drafter/<run>/`) copied into a folder of `directory` named after its objects'
    checksums, which it returns: downloaded once per content, so a run exported again (new weights of the
    same size) is fetched again, and older copies are removed (as `StoredPartition.local_copy` does)."""
    prefix = f"{DRAFTER_PREFIX}/{run}/"
    # The export is flat; nothing else of the run's is read.
    listed = [
        info for info in store.list(prefix) if info.key[len(prefix) :] and "/" not in info.key[len(prefix) :]
    ]
    if not listed:
        raise RunNotTrained(
            f"training run {run!r} has no export in {store.uri(prefix)}: materialise drafter_checkpoints "
            "for it"
        )
    content = hashlib.sha256()
    for info in listed:
        content.update(f"{info.key}\0{info.size}\0{store.checksum(info) or ''}\n".encode())
    version = content.hexdigest()[:16]
    local_dir = Path(directory) / version
    keep_only_version(Path(directory), version)
    for info in listed:
        store.download(info.key, local_dir / info.key[len(prefix) :], size=info.size)
    return local_dir


def held_out_samples(store: ObjectStore, manifest: dict[str, Any], cache_dir: Path) -> list[TokenizedSample]:
    """The run's held-out samples (`eval_sample_indices` of its manifest), read from the tokenized ranges
    it trained on."""
    wanted = {int(i) for i in manifest.get("eval_sample_indices") or []}
    found: list[TokenizedSample] = []
    for key in manifest.get("trained_partitions") or []:
        if not wanted:
            break
        prefix = f"{TOKENIZED_PREFIX}/{key}"
        tokenized = read_manifest(store, prefix)
        if tokenized is None:
            continue
        for sample in load_shard(StoredPartition(store, prefix, tokenized), cache_dir):
            if sample.sample_index in wanted:
                found.append(sample)
                wanted.discard(sample.sample_index)
    return sorted(found, key=lambda sample: sample.sample_index)
