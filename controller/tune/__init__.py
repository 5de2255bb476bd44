"""`multipod tune`'s search of one pod's layout (the command itself is commands/tune.py).

  grid       the candidate layouts (mesh, sequence parallelism, microbatches, remat)
  runner     each candidate measured by the pod-side layout probe in a child process
  table      the ranked table, its JSON, and the best layout's config file
  inference  the search for generation: mesh x generation batch
  cost       the cost model of the cross-pod sync (every-step fused or overlapped, compression,
             DiLoCo): projected step, exposed exchange, DCN bytes, weak scaling; `multipod plan`
  cost_inputs  what the cost model takes: model, layout, chip, links, candidate, calibration
  dcn_session  `multipod tune --dcn`: the pods, the measurements, the trials, the written choice
  dcn_probe    the link measured over ProbeLink, one pod's compute over the layout probe
  dcn_tuner    every cross-pod candidate predicted from those measurements; the choice among trials
  dcn_trials   the best few candidates trained a few steps, measured from their metrics
  dcn_report   the report: predicted against measured, the tiers, the choice
  dcn_plan_file  the measured cluster and calibrated terms as a `multipod plan --from` input
"""
