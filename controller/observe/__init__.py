"""What the run tells the user, as it happens and after: imports only controller.core.

  metrics   metrics.jsonl, TensorBoard events, the progress line, the utilisation formula (MFU/HFU)
  events    events.jsonl: one line per run event (checkpoints, failures, restarts, rewinds)
  peak      the MFU denominator: this machine's per-device matmul peak, measured once and cached
  report    `multipod report`: report.png drawn from metrics.jsonl and events.jsonl
"""
