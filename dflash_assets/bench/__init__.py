"""`dflash-assets bench`: throughput and memory ratios, each measured within one run.

May import every stage; nothing in the package imports it (only the command line does).
"""
