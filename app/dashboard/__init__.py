"""The operator's dashboard: a QuartTrio app on its own port."""
