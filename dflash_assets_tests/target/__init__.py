"""Tests of the target stage: device leases, kernel paths, the demo target."""
