"""The Dagster layer: assets, resources, the IO manager, partitions, sensors, progress and the capacity
plan's metadata, over the plain core below it; `execution/` holds the machinery that runs steps (the
executor, Celery nodes, orphaned steps, dead runs).

May import: every stage of the core (`storage`, `conversations`, `generation`, `target`, `extraction`,
`drafter`, `training`, `planning`), `settings` and `terminal`. Nothing in the core imports this package.
"""
