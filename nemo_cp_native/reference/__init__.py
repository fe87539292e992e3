"""Pure-PyTorch oracles, written from the behavioural specs, plain and obviously right.

They are slow on purpose (Python loops, float64, host syncs where the reference has them).
Users may import them in their own tests:

- ``te_partition``: Transformer Engine's ``thd_get_partitioned_indices`` as a Python loop.
- ``mimo``: the whole MiMo TE-THD sharding path (framework helpers + MiMo wrapper).
- ``sink_attention``: float64 learned-sink attention over packed documents, forward and backward.
- ``magi``: MagiAttention's default dispatch (chunk cap, padding, MinHeap solver) and the
  visible remote-token sets a CP rank needs; ``expand_runs``, the tables a plan's runs describe.
- ``cp_attention``: whole-sequence oracle for context-parallel sink attention.
"""
