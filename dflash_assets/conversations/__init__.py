"""Conversations: reading chat datasets, sample-range keys, the chat template and loss mask, and the
tokenized shard every later stage reads.

May import: `storage`.
"""
