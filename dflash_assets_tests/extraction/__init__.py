"""Tests of the extraction stage: capture, batching, the sample format, extracting a range."""
