"""Tensor parallelism (``--tp-size N``): one scheduler process per rank.

    context.py  what a rank is: its slices of heads, MLP and vocabulary; Shard; WeightCommit
    group.py    the ranks' process group (gloo on CPU, nccl on GPU) and its collectives

The sharded layers are ``models/tp_layers.py``. Starting the ranks and driving them (rank 0's
leader, the other ranks' worker, what rank 0 sends them) is ``rollout_engine/runtime/``
(tp_launch.py, tp_leader.py, tp_worker.py, tp_wire.py).
"""
