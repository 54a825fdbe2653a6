"""Tests of the conversations stage: datasets, sample ranges, the chat template and loss mask."""
