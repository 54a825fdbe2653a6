"""The map of the store: every asset's prefix and the name of every object the product writes there,
spelled once here so the step that writes a key and the one that reads it cannot drift apart
(`docs/store-layout.md` draws the tree).

Plain strings and the string-building of keys; it imports nothing, so every stage may import it.
"""

from __future__ import annotations

# ----------------------------------------------------------------------------------- prefixes

TARGET_COMPLETIONS_PREFIX = "target-completions"  # the target's answers: `<range>/completions.jsonl`
TOKENIZED_PREFIX = "tokenized-completions"  # tokenized conversations: `<range>/shard.parquet`
HIDDEN_STATES_PREFIX = "hidden-states"  # the target's hidden states: `<range>/hs_<index>.safetensors`
CHECKPOINTS_PREFIX = "checkpoints"  # training runs: `<run>/step_<step>/`, `<run>/tensorboard/`, a manifest
DRAFTER_PREFIX = "drafter"  # each run's exported drafter, a model directory: `<run>/config.json`, ...
EVALUATIONS_PREFIX = "evaluations"  # a run's drafter measured on a prompt set: `<run>/<set>/evaluation.json`
# The target's greedy output of a prompt set and prompt lookup's figures on it, which depend on the target,
# the prompts and the budget only: `<identity>.json`, reused by every run's evaluation of the same prompts.
REFERENCES_PREFIX = "evaluation-references"
LAUNCH_PREFIX = "config/training-launch"  # a multi-node launch, for the nodes that join it: `<run>.json`

# Asset name -> its top-level prefix; a range-partitioned asset's partition is `<prefix>/<range>`, while
# `drafter_checkpoints` and `drafter_evaluations` name their own prefixes below theirs (run, then set).
ASSET_PREFIXES = {
    "target_completions": TARGET_COMPLETIONS_PREFIX,
    "tokenized_completions": TOKENIZED_PREFIX,
    "hidden_state_partitions": HIDDEN_STATES_PREFIX,
    "drafter_checkpoints": CHECKPOINTS_PREFIX,
    "drafter_evaluations": EVALUATIONS_PREFIX,
}

# --------------------------------------------------------- beside a partition's objects

MANIFEST_NAME = "_manifest.json"  # a partition's commit marker, written last (`storage/manifest.py`)
FINGERPRINT_NAME = "_fingerprint.json"  # who made a range's objects, written before any of them

# ------------------------------------------------------------------------ names of one asset

COMPLETIONS_NAME = "completions.jsonl"  # a range's answered conversations, every row merged in order
CHUNKS_DIR = "chunks"  # a range's finished conversations while it runs, deleted once merged
SHARD_NAME = "shard.parquet"  # a range's tokenized conversations (`conversations/shard.py`)
EVALUATION_NAME = "evaluation.json"  # one prompt set's evaluation of a run's drafter (`evaluation/report.py`)

# A model directory, as the engines load it: the drafter's export and every checkpoint hold both.
CONFIG_NAME = "config.json"  # the drafter's config (a Qwen3 config plus DFlash's fields)
WEIGHTS_NAME = "model.safetensors"  # the drafter's weights (not the target's embedding and LM head)
MODEL_CARD_NAME = "README.md"  # the export's model card

# A checkpoint, `checkpoints/<run>/step_<step:08d>/`: resumable exactly, committed by its marker.
OPTIMIZER_NAME = "optimizer.pt"  # the optimiser's state
TRAINER_STATE_NAME = "trainer_state.pt"  # step, data position, scheduler, RNG states
TRAIN_SETTINGS_NAME = "train_settings.json"  # the run's TrainSettings
CHECKPOINT_FILES = (WEIGHTS_NAME, OPTIMIZER_NAME, TRAINER_STATE_NAME, CONFIG_NAME, TRAIN_SETTINGS_NAME)
CHECKPOINT_MARKER_NAME = "_complete.json"  # a checkpoint's commit marker, written after its files
TENSORBOARD_DIR = "tensorboard"  # a run's training curves, `checkpoints/<run>/tensorboard/`


def evaluation_prefix(run: str, prompt_set: str) -> str:
    """`evaluations/<run>/<set>`: where one set's evaluation of the run's drafter is committed."""
    return f"{EVALUATIONS_PREFIX}/{run}/{prompt_set}"
