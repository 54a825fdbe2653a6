"""dflash-assets: data preparation and training of a DFlash speculative-decoding drafter, as Dagster assets.

Importing the package sets one process-wide default before torch loads its OpenMP runtime: idle OpenMP
threads sleep (`OMP_WAIT_POLICY=PASSIVE`) instead of spinning. With the default spin, a CPU forward of
the demo target on a busy 2-core machine waits at every operator for a second thread the kernel has not
scheduled: one range of regeneration took 292 s instead of 26 s (docs/testing.md). A value already in
the environment is kept, and a process that imported torch before this package keeps torch's default.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
