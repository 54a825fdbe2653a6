"""What a step process imports before its step runs, imported once by the process that starts steps.

A step process that imports torch, transformers and the stages for itself spends seconds of CPU on it
before its first sample (about 4 s each on a 2-core machine, more from a network file system). So the
process that starts step processes imports them once and every step starts from a copy of it:

- the multiprocess executor's steps fork from a forkserver that preloads this module (`executor.py`);
- a Celery node's step processes fork from its main process, which imports it (`celery_worker.py`).

Both then fork, so importing this module must never initialise CUDA: a process forked after CUDA is
initialised cannot use it. Importing torch and transformers does not, and the stages' modules only touch
the device inside their functions; a test checks that loading this module calls none of torch's
device-count or initialisation functions. The Dagster code location never imports it (loading
`dflash_assets.definitions` stays free of torch).
"""

from __future__ import annotations

import torch  # noqa: F401
import transformers  # noqa: F401
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401  (resolve the lazy modules)

import dflash_assets.conversations.tokenize  # noqa: F401
import dflash_assets.drafter.speculative  # noqa: F401
import dflash_assets.extraction.extract  # noqa: F401
import dflash_assets.extraction.verify  # noqa: F401
import dflash_assets.generation.regenerate  # noqa: F401
import dflash_assets.generation.tokenized  # noqa: F401
import dflash_assets.target.model  # noqa: F401
import dflash_assets.training.data  # noqa: F401
import dflash_assets.training.export  # noqa: F401
import dflash_assets.training.train  # noqa: F401
