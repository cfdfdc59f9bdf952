"""Watching the data path: Prometheus metrics, event-loop stalls, time series."""
