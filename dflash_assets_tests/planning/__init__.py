"""Tests of the capacity plan: the arithmetic, the workload estimate, hours from a saved measurement."""
