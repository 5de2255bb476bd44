"""`multipod tune`'s search of one pod's layout (the command itself is commands/tune.py).

  grid       the candidate layouts (mesh, sequence parallelism, microbatches, remat)
  runner     each candidate measured by the pod-side layout probe in a child process
  table      the ranked table, its JSON, and the best layout's config file
  inference  the search for generation: mesh x generation batch
  cost       the cost model of the cross-pod sync (every-step fused or overlapped, compression,
             DiLoCo): projected step, exposed exchange, DCN bytes, weak scaling; `multipod plan`
"""
