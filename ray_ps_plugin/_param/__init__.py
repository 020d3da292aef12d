"""Async and ssp modes: shards that own the parameters, and the client that pushes deltas."""
