"""A simulated GPU inference server, modelled on llm-d-inference-sim."""
