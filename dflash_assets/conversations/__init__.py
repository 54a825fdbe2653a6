"""Conversations: reading chat datasets (`datasets.py`; JSON arrays `json_array.py`, ShareGPT built in
`sharegpt.py`; rows dropped, told to a person, `drops.py`), sample-range keys (`sample_range.py`),
tokenizing rows (`tokenize.py`) with the chat template's loss mask (`loss_mask.py`), and the tokenized
shard every later stage reads (`shard.py`).

May import: `storage` (and the `settings` leaf, for a default stated there).
"""
