"""One training run, from connecting the pods to the summary.

  training  the run from start to summary: pods, resume or baseline, the loop, recovery, the end
  loop      the step loop: pipelined Step RPCs, each finished step checked and recorded
  summary   the end of a run: a sample from the model, summary.json, the printed summary
"""
