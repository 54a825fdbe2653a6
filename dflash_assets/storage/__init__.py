"""Storage: the object store (S3 or a local directory), its layout (every prefix and object name), the
bounded uploader, local staging, the partition manifest (the commit marker), crash points for tests,
and the loopback S3 launcher.

The lowest stage: it imports nothing else of this package but the `settings` leaf (the crash points'
variable, and defaults stated there once).
"""
