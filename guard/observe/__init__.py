"""What the guard exports: metrics, traces, timelines and forecast error."""
