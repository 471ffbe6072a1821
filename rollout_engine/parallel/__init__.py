"""Tensor parallelism (``--tp-size N``): one scheduler process per rank.

    context.py  what a rank is: its slices of heads, MLP and vocabulary; Shard; WeightCommit
    group.py    the ranks' process group (gloo on CPU, nccl on GPU) and its collectives
    layers.py   row-parallel linear, vocab-parallel embedding and LM head
    wire.py     what rank 0 sends the other ranks: forward inputs, control ops, their answers

Starting the ranks and driving them (rank 0's leader, the other ranks' worker) is
``rollout_engine/runtime/`` (tp_launch.py, tp_leader.py, tp_worker.py).
"""
