"""`bench --gpu`'s tensor-parallel rows: capture tokens/s with the target split over k = 1, 2, 4 devices
(as many as the node has: CUDA devices, or two gloo ranks on the CPU with `--tiny`).

A random-weight checkpoint of the hybrid shape is saved once to a temporary directory and loaded by each
rank through the product's own path (`load_target_shard`: transformers' tensor-parallel plan); k ranks
are started by torch.distributed's launcher, rank 0 sends each batch to the others and captures it
(`HiddenStateCapture`, hooks and early stop, the result copied to the host as extraction does), and
reports the median of its rounds. Nothing is written to a store: these rows measure the split forward.

    python -m dflash_assets.bench.tensor_parallel MODEL_DIR RESULT.json TOKENS BUDGET ROUNDS   (a rank)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TP_COUNTS = (1, 2, 4)
CAPTURE = "capture"


def device_counts(device: torch.device) -> list[int]:
    """The k the node can run: up to its CUDA devices, or 2 ranks on the CPU."""
    available = torch.cuda.device_count() if device.type == "cuda" else 2
    return [k for k in TP_COUNTS if k <= available]


def tensor_parallel_rows(
    shape: Any,
    build: Callable[[Any, torch.device], torch.nn.Module],
    samples: list[Any],
    device: torch.device,
    budget: int,
    rounds: int,
    print_fn: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """One row per k: tokens/s of rank 0's capture over `samples`, and its ratio to k = 1."""
    counts = device_counts(device)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dflash-bench-tp-") as tmp:
        model_dir = Path(tmp) / "target"
        model = build(shape, torch.device("cpu") if device.type == "cpu" else device)
        model.save_pretrained(model_dir)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        tokens = sum(s.num_tokens for s in samples)
        (Path(tmp) / "samples.json").write_text(json.dumps([s.input_ids for s in samples]))
        for k in counts:
            result = Path(tmp) / f"tp{k}.json"
            _launch(k, model_dir, result, Path(tmp) / "samples.json", budget, rounds, device)
            seconds = json.loads(result.read_text())["seconds"]
            rows.append({"tp": k, "tokens_per_s": tokens / seconds, "tokens": tokens})
    for row in rows:
        row["vs_one_device"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    print_fn(f"\n{shape.name} split over devices (capture, rank 0's median of {rounds} rounds):")
    for row in rows:
        print_fn(
            f"  target over {row['tp']} device{'s' if row['tp'] > 1 else ' '}   "
            f"{row['tokens_per_s']:10,.0f} tokens/s   {row['vs_one_device']:.2f}x one device"
        )
    if len(counts) < len(TP_COUNTS):
        print_fn(
            f"  (k = {', '.join(str(k) for k in TP_COUNTS if k not in counts)}: not enough devices here)"
        )
    return rows


def _launch(
    k: int, model_dir: Path, result: Path, samples: Path, budget: int, rounds: int, device: torch.device
) -> None:
    env = dict(os.environ)
    env.setdefault(
        "OMP_NUM_THREADS", "1" if device.type == "cpu" else str(max(1, (os.cpu_count() or 1) // k))
    )
    if device.type == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={k}"]
    command += ["-m", "dflash_assets.bench.tensor_parallel"]
    command += [str(model_dir), str(result), str(samples), str(budget), str(rounds)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the bench's {k} ranks failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    from dflash_assets.bench.capture_ways import synchronize
    from dflash_assets.extraction.capture import HiddenStateCapture
    from dflash_assets.target.batching import pad_batch, plan_batches
    from dflash_assets.target.layer_ids import dflash_target_layer_ids
    from dflash_assets.target.model import load_target_model, num_decoder_layers
    from dflash_assets.target.tensor_parallel import TargetGroup, load_target_shard

    model_dir, result, samples_file, budget, rounds = (argv or sys.argv[1:])[:5]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = TargetGroup(device, timeout_s=600)
    model = (
        load_target_shard(model_dir, device, group.size)
        if group.size > 1
        else load_target_model(model_dir, device)
    )
    layer_ids = dflash_target_layer_ids(num_decoder_layers(model.config), 5)
    capture = HiddenStateCapture(model, layer_ids)
    if not group.is_leader:
        group.follow({CAPTURE: lambda ids, mask: capture(ids, mask)})
        group.close()
        return 0
    sequences = json.loads(Path(samples_file).read_text())
    batches = plan_batches([len(s) for s in sequences], int(budget))
    padded = [pad_batch([sequences[i] for i in batch], 0) for batch in batches]

    def one_pass() -> float:
        start = time.perf_counter()
        for ids, mask in padded:
            group.send(CAPTURE, ids, mask)
            capture(ids, mask).to("cpu")
        synchronize(device)
        return time.perf_counter() - start

    one_pass()  # warm-up
    seconds = statistics.median(one_pass() for _ in range(int(rounds)))
    group.stop_followers()
    Path(result).write_text(json.dumps({"seconds": seconds, "tp": group.size}))
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
