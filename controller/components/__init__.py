"""The step loop's components: each decides for itself when it acts.

  checkpointer  when to save, the saves in flight, the last good checkpoint, restoring from it
  evaluation    held-out evaluation on every pod, every run.eval_every steps and at the end
  failover      degraded mode: a failed pod's shard goes to the survivors; it rejoins from a peer
  recovery      restore every pod from the last good checkpoint; rewind after a loss spike
  spike         the loss-spike policy
"""
