"""Tests of the Dagster layer, through real instances and the `dagster` / `dflash-assets` commands."""
