"""Parity harness: contracts between reference and fast path."""
