"""Tests of the generation stage: turn planning, the engines, exactly-once regeneration of a range."""
