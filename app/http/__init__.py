"""HTTP/1.1 for every server and client Sluice runs on its hot paths, standing alone.

Pure parsing (request_head, response_head, fields, framing) that is fed bytes and hands back
values; a connection's state as a table (connection.py) that only the connection changes;
thin I/O over sockets and memory streams (streams.py); the server (server.py), the client
pool (client.py) and the relay hub (relay_hub.py) built on them; a listener's graceful end
(graceful.py), the gRPC server's too. Nothing here imports the
rest of `app`: the proxy and the simulated backend both build on this package.
"""
