"""Start-up: the `sluice` command (flags, environment, TOML -> one frozen Settings) and each
way to run it, wired once: serve, workers under a supervisor, demo, sim-backend."""
