"""The step loop's components: each decides for itself when it acts, and each takes its own
section of the config in its constructor (what the whole run shares, such as run.steps and the
deadlines, it reads from the cluster's config):

  checkpointer  [checkpoint]: when to save, the saves in flight, the last good checkpoint, restoring from it
  evaluation    [eval]: held-out evaluation on every pod, every eval.every steps and at the end
  failover      [recovery]: degraded mode: a failed pod's shard goes to the survivors; it rejoins from a peer
  recovery      [recovery]: restore every pod from the last good checkpoint; rewind after a loss spike
  replay        [sync]: DiLoCo's replay: a survivor rebuilds a failed pod's own state from its checkpoint part
  spike         [spike]: the loss-spike policy
"""
