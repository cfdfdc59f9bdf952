"""The data path on app/http's server: admission -> preprocess -> route -> forward -> relay."""
