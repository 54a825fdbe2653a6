"""The target model: loading it on a device, its decoder layers and the DFlash layer rule, device
leases, kernel paths, and the built-in demo target.

May import: `storage`, `conversations`.
"""
