"""The runtime."""
