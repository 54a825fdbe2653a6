"""Tests of the drafter: the model and objective, the export, the mask token, speculative decoding."""
