"""Backends (health, load, circuit breaker) and the policies that choose between them."""
