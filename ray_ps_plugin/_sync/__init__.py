"""Sync mode: summation shards (BytePS) and the DDP communication hook that feeds them."""
