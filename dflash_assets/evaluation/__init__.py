"""What a trained drafter is worth on the traffic it will serve: prompt sets (`prompt_sets.py`), the
drafter measured on each beside the training-free prompt-lookup floor (`measure.py`), and stored
evaluations of several runs side by side (`compare.py`).

May import: `conversations`, `generation` (the chat template's prompt, as regeneration renders it),
`drafter`, `target`, `storage` (and the `settings` leaf, for a default stated there).
"""
