"""The target model: loading it on a device, its decoder layers and the DFlash layer rule, device
leases, kernel paths, and the built-in demo target.

May import: `storage`, `conversations`. Batching by length lives here because every stage that runs
the target (extraction, generation, online training) batches its forward passes the same way.
"""
