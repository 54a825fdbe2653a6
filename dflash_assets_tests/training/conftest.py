"""The tiny target, drafter config, capture and samples the training tests share
(`support/tiny_target.py`)."""

from dflash_assets_tests.support.tiny_target import capture, config, samples, target, target_dir  # noqa: F401
