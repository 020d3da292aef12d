"""The direct path: frames on TCP streams between workers and shards.

Through Ray's object store every cross-node chunk is an object that is created,
sealed, located, pulled and read back; and a Ray call with its reply costs a worker
about a millisecond of CPU on a loaded machine. Here each message is a frame on a
long-lived TCP connection a worker (or a relay shard, or a primary shard to its
replica) keeps to each shard it pushes to. Ray still starts, places and supervises
every process, and hands out the shards' addresses and the run's token; only the
bytes bypass it.

- ``frames``: the format (header, kinds, keys, the run's token) and the blocking
  helpers both ends read and write frames with;
- ``server``: a shard's listening end (``WireServer``);
- ``streams``: the pushers' connections (``WireStreams``);
- ``setup``: opening every shard's end at a run's start (``Wires``).

Shared plumbing: imports only the leaves (``_dtypes``, ``_errors``, ``_types``).
"""
