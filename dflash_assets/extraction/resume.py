"""What a range's store prefix and staging directory already hold, so a rerun computes only the gaps.

Steps 1, 2, 3 and 5 of `extract_range`: one listing that drops objects of another fingerprint, the
objects already stored, finished files in staging (uploaded as they are), and the final check that
the store holds every object this run needs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.extraction.monitor import UploadRecord
from dflash_assets.extraction.object_size import min_sample_nbytes
from dflash_assets.extraction.sample_format import (
    estimate_sample_nbytes,
    parse_sample_object_name,
    sample_object_name,
    staged_file_problem,
)
from dflash_assets.storage.fingerprint import claim_prefix
from dflash_assets.storage.manifest import changed_since_commit, read_manifest
from dflash_assets.storage.staging import StagingDirectory
from dflash_assets.storage.store import ObjectStore, StoreError
from dflash_assets.storage.uploader import Uploader


class ExtractionIncomplete(StoreError):
    """After the uploads finished, the store still lacks objects this range needs."""


def earlier_fingerprints(fingerprint: dict[str, Any]) -> list[dict[str, Any]]:
    """Fingerprints earlier versions wrote for objects this one would make the same way: before
    fingerprints named what the objects were made from (`made_from`; the store's objects were made for
    it, the store being this pipeline's), and format 1, bf16 only and naming no dtype. Such a range is
    kept (its objects are read as they are), not redone."""
    current = {key: value for key, value in fingerprint.items() if key != "made_from"}
    earlier = [current] if current != fingerprint else []
    if fingerprint["hidden_state_dtype"] == "bf16":
        legacy = {key: value for key, value in current.items() if key != "hidden_state_dtype"}
        earlier.append({**legacy, "format": "dflash-assets.hidden-states/1"})
    return earlier


class RangeInStore:
    """The range's prefix in the store: who made its objects, which are complete, and the final check."""

    def __init__(
        self,
        store: ObjectStore,
        prefix: str,
        fingerprint: dict[str, Any],
        by_index: dict[int, TokenizedSample],
        capture: HiddenStateCapture,
        target_model_name: str,
        warn: Callable[[str], None],
    ) -> None:
        self.store = store
        self.base = prefix.strip("/") + "/"
        self.where = store.uri(self.base.rstrip("/"))
        self.fingerprint = fingerprint
        self.by_index = by_index
        self.num_layers = len(capture.target_layer_ids)
        self.hidden_size = capture.hidden_size
        self.metadata_nbytes = len(target_model_name.encode())
        self.hidden_state_dtype: str = fingerprint["hidden_state_dtype"]  # bf16 or fp8, the whole range
        self.final_state = capture.final_state  # the target's final state beside the layers
        self.warn = warn

    def reconcile_fingerprint(self) -> dict[str, int]:
        """One listing of the prefix; objects made under another fingerprint (or none) are deleted."""
        # The fingerprint is written before any sample object, so an object never lacks one.
        earlier = earlier_fingerprints(self.fingerprint)
        return claim_prefix(self.store, self.base, self.fingerprint, self.warn, equivalent=earlier)

    def objects_already_stored(self, listed: dict[str, int]) -> set[int]:
        changed = self._changed_since_commit()
        done: set[int] = set()
        for name, size in listed.items():
            if name in changed:
                continue
            index = parse_sample_object_name(name)
            if index is None or index not in self.by_index:
                continue
            low, high = self._size_bounds(self.by_index[index].num_tokens)
            if low <= size <= high:
                done.add(index)
            else:  # cannot be a complete object for this sample: recompute and overwrite it
                self.warn(
                    f"{self.store.uri(self.base + name)} has {size} bytes, expected {low}..{high}; redoing it"
                )
        return done

    def _changed_since_commit(self) -> set[str]:
        """Objects of a committed range whose bytes changed since (the manifest's checksums, compared
        without downloading): extracted again and overwritten, never reused."""
        manifest = read_manifest(self.store, self.base.rstrip("/"))
        if manifest is None:
            return set()
        changed = changed_since_commit(self.store, self.base.rstrip("/"), manifest)
        for problem in changed.values():
            self.warn(f"{self.where}: {problem}; extracting it again")
        return set(changed)

    def _size_bounds(self, num_tokens: int) -> tuple[int, int]:
        """Sizes a complete object of this sample can have, in the range's stored dtype."""
        shape = (num_tokens, self.num_layers, self.hidden_size)
        low = min_sample_nbytes(*shape, self.hidden_state_dtype, self.final_state)
        high = estimate_sample_nbytes(*shape, self.metadata_nbytes, self.hidden_state_dtype, self.final_state)
        return low, high

    def verify_store(self, uploaded_sizes: dict[str, int], dropped: dict[int, str]) -> dict[str, int]:
        self.store.sync(self.base)  # before the manifest can be written: every object's name is durable
        listed = {info.key[len(self.base) :]: info.size for info in self.store.list(self.base)}
        expected = sorted(sample_object_name(i) for i in self.by_index if i not in dropped)
        missing = [name for name in expected if name not in listed]
        if missing:
            raise ExtractionIncomplete(
                f"{len(missing)} of {len(expected)} objects are missing from {self.where} after all uploads "
                f"were confirmed (first: {missing[0]}); something else deleted them. Rerun the range: "
                "finished objects are kept and only the gaps are redone"
            )
        for name in expected:
            uploaded = uploaded_sizes.get(name)
            if uploaded is not None and listed[name] != uploaded:
                raise ExtractionIncomplete(
                    f"{self.store.uri(self.base + name)} has {listed[name]} bytes but {uploaded} were "
                    "uploaded; something else overwrote it. Rerun the range"
                )
        return {name: listed[name] for name in expected}


def resubmit_staged(
    staging: StagingDirectory,
    partition: RangeInStore,
    uploader: Uploader,
    uploads: UploadRecord,
    in_store: set[int],
    log: Callable[[str], None],
    warn: Callable[[str], None],
) -> set[int]:
    """Upload the complete files an earlier run left behind; delete everything else in staging."""
    resubmitted: set[int] = set()
    removed: list[str] = []
    for path in staging.sample_files():
        index = parse_sample_object_name(path.name)
        if index is None or index not in partition.by_index or index in in_store:
            # Temp files of a killed writer, strays, or files uploaded just before a crash.
            path.unlink(missing_ok=True)
            removed.append(path.name)
            continue
        problem = staged_file_problem(
            path,
            partition.by_index[index],
            {key: value for key, value in partition.fingerprint.items() if key != "made_from"},
            partition.num_layers,
            partition.hidden_size,
        )
        if problem is not None:
            warn(f"staged {path.name} is unusable ({problem}); recomputing sample {index}")
            path.unlink(missing_ok=True)
            continue
        uploader.submit(path, partition.base + path.name, on_uploaded=uploads)
        resubmitted.add(index)
    if removed:
        log(f"staging: removed {len(removed)} leftover files that need no upload (e.g. {removed[0]})")
    return resubmitted
