"""The operations the commands run: load, inspect, and the rewrites (reshard, convert,
dedupe). Each returns a dataclass; the CLI renders it."""
