"""Tensor parallelism (``--tp-size N``): one scheduler process per rank.

    context.py  what a rank is: its slices of heads, MLP and vocabulary; Shard; WeightCommit
    group.py    the ranks' process group (gloo on CPU, nccl on GPU) and its collectives
    layers.py   row-parallel linear, vocab-parallel embedding and LM head
    wire.py     what rank 0 sends the other ranks: forward inputs, control ops, their answers
    leader.py   rank 0's side: the other ranks' pipes, mirrored control calls, liveness
    worker.py   the other ranks: a model shard and its KV pool, driven by rank 0
    launch.py   starting the ranks (rank 0 starts the others) and the group
"""
