"""How steps run: the code location's executor (local processes from a preloaded forkserver, Kubernetes
Jobs, or Celery worker nodes), what a step does when its run worker dies, and the reaper of dead runs.

May import: the rest of `orchestration` only through `definitions` (a step rebuilds its job from it),
`settings`, and the core stages.
"""
