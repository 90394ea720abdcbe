"""The benchmark library behind scripts/: clients, workloads, servers, stats, plots, verdicts."""
