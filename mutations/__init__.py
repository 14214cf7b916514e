"""Mutation catalog and runner: every contract can go red."""
