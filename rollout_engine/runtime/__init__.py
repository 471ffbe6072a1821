"""Everything that starts, hosts and talks to a scheduler.

    start.py      start_scheduler(config): the host ``Engine`` hands to its frontend
    hosts.py      ThreadHost, ProcessHost (a scheduler in a thread or a child process)
    dp_host.py    DataParallelHost + DataParallelChannel (``--dp-size N`` replicas, one channel)
    spawn.py      spawn_child: the one way a scheduler process starts; ChildStart
    child.py      the child's entry point (loop, TP rank 0 or a TP rank > 0)
    channels.py   Channel, QueueChannel, PipeChannel
    loop.py       run_loop: typed messages in, scheduler steps, outputs out
    tp_launch.py  starting tensor-parallel ranks (rank 0 starts the others) and the group
    tp_leader.py  rank 0's side: the other ranks' pipes, mirrored control calls, liveness
    tp_worker.py  a rank other than 0: a model shard and its KV pool, driven by rank 0

``rollout_engine.scheduler`` (the step as a library) never imports this package.
"""
