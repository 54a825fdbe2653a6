"""Extraction: capturing target hidden states, batching by length, moving them to the host, the
hidden-state object format, extracting a range exactly once, and verifying a committed range.

May import: `storage`, `conversations`, `target` (and the `settings` leaf, for a default stated there).
"""
