"""Capacity tools."""
