"""Tests of the evaluation stage: prompt sets, the drafter measured beside the floor, stored evaluations
reported and compared."""
