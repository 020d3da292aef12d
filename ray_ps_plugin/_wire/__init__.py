"""The direct path: frames on TCP streams between workers and shards.

``frames`` is the format (header, kinds, the run's token) and the blocking helpers
both ends read and write it with; ``path`` the shard's listening end
(``WireServer``) and the pushers' connections (``WireStreams``).

Shared plumbing: imports only the leaves (``_dtypes``, ``_errors``).
"""
