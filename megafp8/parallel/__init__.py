"""Parallelism: the TP x DP x PP layout and its process groups, byte-counted collectives, TP/SP mappings,
tensor-parallel layers, sharding helpers and vocab-parallel cross-entropy."""
