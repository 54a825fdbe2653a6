"""How steps run: the code location's executor (local processes from a preloaded forkserver, Kubernetes
Jobs, or Celery worker nodes), what a step does when its run worker dies, the reaper of dead runs, and
assets run in this process (`in_process`: the demo's, the benchmark scripts').

May import: the rest of `orchestration` only through `definitions` (a step rebuilds its job from it),
`resources`, `partitions` (ranges registered) and `user_errors` (a failure told in one line),
`settings`, and the core stages.
"""
