"""Helpers shared by the test folders (not tests themselves)."""
