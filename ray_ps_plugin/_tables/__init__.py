"""Embedding tables trained on the shards, row by row.

Sharded tables (a layer built on the meta device: no worker holds it) and, with
``sparse_optimizer="shards"``, real tables whose optimizer the shards apply (sync:
every worker's copy written from the shards' answers; async and ssp: rows looked up).

Modules: ``layers`` (which layers are tables, and the refusals), ``client`` (the
worker's lookups, steps and copies: ``ShardedTables``), ``checkpoint`` (slices of
rows to and from files), ``store`` (a shard's rows and clocks: ``TableStore``),
``optim`` (SGD, Adagrad and SparseAdam on rows, with torch's bits), ``frames``
(pulls and pushes as bytes for the direct path).

May import the shared pieces and leaves below it, never a mode's package, the
runtime or the backend.
"""
