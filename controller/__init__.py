"""The controller: one process that owns the run. A package of subpackages, each a concern, each
importing only those before it in this list (tests/unit/test_ladder.py checks it):

  core        the run's config, its error types, the test fault hooks
  observe     metrics.jsonl, events.jsonl, the progress line, peak FLOP/s, report.png
  data        sources, tokenizers, the token cache, datasets, per-pod shards
  cluster     the typed clients of the workers, pods of several hosts, the Cluster
  components  checkpointer, evaluation, failover, recovery, spike policy
  run         a training run: its step loop, its end
  launch      workers started by the controller: local subprocesses, Ray actors
  tune        the layout search of `multipod tune`
  commands    the CLI: one module per command with code of its own
"""
