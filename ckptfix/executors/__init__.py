"""Executors other than this process: `--executor ray` runs the reads of `hash`, `diff` and
`inspect` as Ray tasks (ray_cluster joins or starts the cluster and runs the tasks, ray_work
plans them and holds what a task runs). Nothing here imports ray until a command asks for it.
"""
