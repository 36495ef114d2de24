"""Collectives that beat the general-purpose backends where the ranks share a host."""
