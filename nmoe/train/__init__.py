"""Trainer: fast path only."""
