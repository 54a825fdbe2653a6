"""`dflash-assets bench`: throughput and memory ratios, each measured within one run; and z-lab's client
of an export (`zlab`), which the benchmark scripts and the tests run beside the product's loop.

May import every stage; nothing in the package imports it (only the command line and `scripts/` do).
"""
