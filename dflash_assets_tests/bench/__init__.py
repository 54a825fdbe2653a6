"""Tests that the benchmarks run and print their ratios."""
