"""The data path on app/http's server: admission -> preprocess -> route -> forward -> relay.

app.py dispatches a request, inference.py walks it through preprocessing, to_backend.py asks
the decision and sends it to the chosen backend (retrying once elsewhere), relay.py turns the
backend's answer into the client's reply; headers.py says which headers cross each way,
forward_tokens.py what `--forward tokens` sends instead of the client's body.
"""
