"""The tiny target, its model and a drafter config for it, shared by the drafter tests
(`support/tiny_target.py`)."""

from dflash_assets_tests.support.tiny_target import config, target, target_dir  # noqa: F401
