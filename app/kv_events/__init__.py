"""The engines' KV-cache events (vLLM's and SGLang's ZMQ publishers): the wire format, the
subscriber on the Trio loop, and their application to the routing prefix index."""
