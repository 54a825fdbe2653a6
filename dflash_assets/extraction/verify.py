"""Verification of a committed hidden-state partition: complete, every object in the store with the size
and checksum its manifest recorded (compared without downloading anything), and a sample of them
decodable, finite, and stored in the dtype the range was extracted in (bf16, or fp8 with its
per-token-and-layer scales), with the target's final state where the range says it has it."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_assets.extraction.sample_format import parse_sample_object_name, read_sample
from dflash_assets.storage.manifest import changed_since_commit, read_manifest
from dflash_assets.storage.store import ObjectStore


@dataclass
class PartitionReport:
    prefix: str
    problems: list[str] = field(default_factory=list)
    samples_expected: int = 0
    samples_listed: int = 0
    objects_present: int = 0
    objects_decoded: int = 0

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def summary(self) -> str:
        if self.passed:
            return (
                f"{self.samples_listed} samples listed, all present with their recorded sizes and "
                f"checksums; {self.objects_decoded} decoded with the right shapes and finite values"
            )
        return f"{len(self.problems)} problem(s); first: {self.problems[0]}"

    def metadata(self) -> dict[str, Any]:
        return {
            "samples_expected": self.samples_expected,
            "samples_listed": self.samples_listed,
            "objects_present": self.objects_present,
            "objects_decoded": self.objects_decoded,
            "problems": "\n".join(self.problems[:20]) or "none",
        }


def verify_hidden_state_partition(
    store: ObjectStore,
    prefix: str,
    *,
    expected_indices: list[int],
    target_layer_ids: list[int],
    decode_samples: int = 1,
    seed: int = 0,
    hidden_state_dtype: str | None = None,
) -> PartitionReport:
    """`hidden_state_dtype` (`bf16`/`fp8`): the dtype every decoded object must be stored in (None:
    either, as long as the objects agree with each other)."""
    report = PartitionReport(prefix=prefix, samples_expected=len(expected_indices))
    manifest = read_manifest(store, prefix)
    if manifest is None:
        report.problems.append(f"{store.uri(prefix)} has no manifest")
        return report

    listed = {
        index: name
        for name in manifest.get("objects", {})
        if (index := parse_sample_object_name(name)) is not None
    }
    report.samples_listed = len(listed)
    missing_from_manifest = sorted(set(expected_indices) - set(listed))
    if missing_from_manifest:
        report.problems.append(
            f"manifest omits {len(missing_from_manifest)} sample(s), first index {missing_from_manifest[0]}"
        )
    unexpected = sorted(set(listed) - set(expected_indices))
    if unexpected:
        report.problems.append(
            f"manifest lists {len(unexpected)} unexpected sample(s), first {unexpected[0]}"
        )

    changed = changed_since_commit(store, prefix, manifest)  # every object, nothing downloaded
    report.problems.extend(changed.values())
    report.objects_present = len(manifest.get("objects", {})) - len(changed)

    rng = random.Random(seed)
    names = sorted(n for n in listed.values() if n not in changed)
    expected_dtype = hidden_state_dtype or manifest.get("hidden_state_dtype")
    for name in rng.sample(names, min(decode_samples, len(names))):
        problem = _decode_problem(
            store,
            f"{prefix}/{name}",
            listed_index=parse_sample_object_name(name),
            target_layer_ids=target_layer_ids,
            hidden_state_dtype=expected_dtype,
            final_state=manifest.get("final_hidden_states"),
        )
        if problem:
            report.problems.append(f"{name}: {problem}")
        else:
            report.objects_decoded += 1
    return report


def _decode_problem(
    store: ObjectStore,
    key: str,
    *,
    listed_index: int | None,
    target_layer_ids: list[int],
    hidden_state_dtype: str | None,
    final_state: bool | None = None,
) -> str | None:
    """What is wrong with one object, or None. `final_state`: whether the range's manifest says its objects
    hold the target's final state (None: a range committed before it was recorded)."""
    try:
        sample = read_sample(store.get_bytes(key))
    except Exception as error:  # any decode failure is a finding, not a crash of the check
        return f"does not decode: {error}"
    hidden = sample.hidden_states
    tokens = sample.input_ids.shape[0]
    if hidden.dim() != 3 or hidden.shape[0] != tokens or hidden.shape[1] != len(target_layer_ids):
        return f"hidden_states shape {tuple(hidden.shape)}, expected [{tokens}, {len(target_layer_ids)}, H]"
    if sample.loss_mask.shape[0] != tokens:
        return f"loss_mask has {sample.loss_mask.shape[0]} entries for {tokens} tokens"
    if hidden_state_dtype is not None and sample.hidden_state_dtype != hidden_state_dtype:
        return f"stored as {sample.hidden_state_dtype}, but the range was extracted as {hidden_state_dtype}"
    expected_dtype = torch.float8_e4m3fn if sample.hidden_state_dtype == "fp8" else torch.bfloat16
    if hidden.dtype != expected_dtype:
        return f"hidden_states are {hidden.dtype}, expected {expected_dtype} for {sample.hidden_state_dtype}"
    scale = sample.hidden_states_scale
    if scale is not None:
        if tuple(scale.shape) != (tokens, len(target_layer_ids)):
            expected = [tokens, len(target_layer_ids)]
            return f"hidden_states_scale shape {tuple(scale.shape)}, expected {expected}"
        if not bool((scale > 0).all()):
            return "hidden_states_scale holds a zero, negative or NaN scale"
    if not bool(torch.isfinite(sample.dequantized()).all()):
        return "hidden_states contain non-finite values"
    if final_state is not None and sample.has_final_state != bool(final_state):
        held = "holds" if sample.has_final_state else "lacks"
        return (
            f"{held} final_hidden_states, where the range's manifest says final_hidden_states={final_state}"
        )
    if sample.has_final_state:
        final = sample.final_hidden_states
        if tuple(final.shape) != (tokens, hidden.shape[2]) or final.dtype != expected_dtype:
            expected = f"[{tokens}, H] {expected_dtype}"
            return f"final_hidden_states {tuple(final.shape)} {final.dtype}, expected {expected}"
        if not bool(torch.isfinite(sample.final_dequantized()).all()):
            return "final_hidden_states contain non-finite values"
    if sample.sample_index != listed_index:
        return f"metadata sample_index {sample.sample_index} != name index {listed_index}"
    if list(sample.target_layer_ids) != list(target_layer_ids):
        return f"target_layer_ids {sample.target_layer_ids} != {target_layer_ids}"
    return None
