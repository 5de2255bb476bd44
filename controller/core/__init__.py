"""What every part of the controller shares, and nothing else: the lowest rung of its ladder.

  run_config   the run's typed configuration (defaults <- TOML <- --set), validated on load
  policies     the run's policy choices (on a pod failure, on a loss spike) as enums, free of jax
  errors       RunError and PodFailure: what stops a run, and what a recovery can fix
  fault_hooks  fault injection for tests, read from the environment, never from the config
  exit_deadline  a deadline on the process's exit once its command has returned
  interrupt    a Ctrl-C that is never lost (raised again by the step loop if a finaliser swallowed it)
  run_lock     one controller per run directory at a time (an flock the kernel drops with the process)
"""
