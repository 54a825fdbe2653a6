"""Training the drafter: settings, data (offline from the store or online beside the target), schedule,
metrics, checkpoints, and the loop.

May import: every stage below it (`storage`, `conversations`, `target`, `extraction`, `drafter`).
"""
