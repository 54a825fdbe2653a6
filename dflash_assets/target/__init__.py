"""The target model: loading it on a device, its decoder layers and the DFlash layer rule, device
leases, kernel paths, and the built-in demo target.

May import: `storage`, `conversations`. Batching by length lives here because every stage that runs
the target (extraction, generation, online training) batches its forward passes the same way.
"""

from dflash_assets.target.fallback_notice import quiet_cpu_kernel_fallbacks

quiet_cpu_kernel_fallbacks()  # every process that runs a target: no CUDA-kernel notice for CPU calls
