"""The pods as the controller sees them: every call to a worker goes through here (and protos).

  api         PodApi: the typed interface to one pod, a method per PodWorker RPC (and Pending)
  client      WorkerClient: one worker's channel, deadlines on every call, errors naming the pod
  pod_client  PodClient: a pod of several hosts behind the same PodApi as one worker
  addresses   the pods' HOST:PORT lists: `--workers` parsed, one pod's hosts checked
  pods        Cluster: connect, configure, the pods' agreement, the watchdog, the diagnosis
  spares      SparePool: standby pods for hot-swap, checked; offers read from RUN_DIR/spares
  compile_marks  CompileMarks: which configurations the pods' shared compilation cache holds
"""
