"""The controller: CLI, config, data pipeline, dispatch loop, local launcher, metrics."""
