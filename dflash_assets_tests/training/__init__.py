"""Tests of training: the loop, checkpoints, streaming from the store."""
