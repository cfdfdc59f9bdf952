"""The endpoint-picker door: Envoy ext_proc, the Gateway API Inference Extension EPP protocol."""
