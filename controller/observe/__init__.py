"""What the run tells the user, as it happens and after: imports only controller.core.

  records        StepRecord: one step's record, the schema of metrics.jsonl's step lines
  metrics        metrics.jsonl, TensorBoard events, the progress line, the utilisation formula (MFU/HFU)
  events         events.jsonl: one Event per line (checkpoints, failures, restarts, rewinds), EventKind
  peak           the MFU denominator: this machine's per-device matmul peak, measured once and cached
  report         `multipod report`: report.png drawn from metrics.jsonl and events.jsonl
  report_input   the report's reading of metrics.jsonl and events.jsonl (ReportError)
  report_series  the report's named series: what it plots, from the parsed lines
  report_figure  the report's matplotlib Figure of those series
"""
