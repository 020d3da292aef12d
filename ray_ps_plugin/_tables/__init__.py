"""Embedding tables trained on the shards, row by row.

Sharded tables (a layer built on the meta device: no worker holds it) and, with
``sparse_optimizer="shards"``, real tables whose optimizer the shards apply (sync:
every worker's copy written from the shards' answers; async and ssp: rows looked up).

Modules: ``layers`` (which layers are tables, and the refusals), ``client`` (the
worker's lookups, steps and copies: ``ShardedTables``), ``transfer`` (a table's rows
written to and read from the shards, slice by slice), ``checkpoint`` (slices of rows
to and from files), ``store`` (a shard's rows and clocks: ``TableStore``), ``block``
(one table's rows on a shard), ``optim`` (SGD, Adagrad and SparseAdam on rows,
with torch's bits), ``frames`` (pulls and pushes as bytes for the direct path),
``host`` (the shard's table methods).

May import the shared pieces and leaves below it, never a mode's package, the
runtime or the backend.
"""
