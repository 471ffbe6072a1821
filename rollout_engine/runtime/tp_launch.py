"""Starting an engine's tensor-parallel ranks (``tp_size > 1``).

    frontend --socket--> rank 0 (the scheduler child, as with one rank)
                           |-- starts ranks 1..N-1 as its own children (the same child entry
                           |   point: a fresh interpreter over an inherited socket pair)
                           |-- hosts the TCPStore the group meets on (a free port, sent to
                           |   each rank in its start message)
                           '-- runs the scheduler loop on a TPLeaderChannel

Every rank exits with its parent: the others when rank 0 goes, rank 0 when the frontend goes.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Optional

import torch
import torch.distributed as dist

from rollout_engine.config import EngineConfig
from rollout_engine.parallel.context import TPContext, installed
from rollout_engine.parallel.group import TPGroup, join_tp_group
from rollout_engine.protocol.messages import SchedulerDied
from rollout_engine.runtime.channels import Channel
from rollout_engine.runtime.loop import run_loop
from rollout_engine.runtime.spawn import ChildStart, spawn_child
from rollout_engine.runtime.tp_leader import Leader, LeaderCommit, TPLeaderChannel

__all__ = ["RankProcess", "TPStart", "rank_device", "run_leader", "run_worker"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TPStart:
    """What a rank > 0 is told when it starts."""

    rank: int
    size: int
    store_port: int


class RankProcess:
    """Rank ``start.rank`` in a child process of rank 0 (``spawn_child``, as the frontend
    starts rank 0), talking to rank 0 over an inherited socket pair; the environment is rank
    0's own."""

    def __init__(self, config: EngineConfig, start: TPStart) -> None:
        self.proc, self.conn = spawn_child()
        self.pid = self.proc.pid
        try:
            self.conn.send(ChildStart(config, list(sys.path), start))
        except OSError:
            pass   # it died at once: rank 0 reports it


def collective_timeout(config: EngineConfig) -> float:
    """Seconds a forward's collective may take: ``dist_timeout``, else the watchdog's."""
    return float(config.dist_timeout or config.watchdog_timeout)


def start_timeout(config: EngineConfig) -> float:
    """Seconds to start (a rank's interpreter, its load) or to answer rank 0 (a refit)."""
    return max(float(config.watchdog_timeout), collective_timeout(config))


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """CPU, or GPU ``base + rank`` (``--base-gpu-id`` / ``device="cuda:base"``)."""
    device = config.resolved_device()
    if device.type != "cuda":
        return device
    device = torch.device("cuda", (device.index or 0) + rank)
    torch.cuda.set_device(device)
    return device


def run_leader(config: EngineConfig, chan: Channel) -> None:
    """Rank 0: start the others, join the group, run the scheduler loop."""
    timeout = start_timeout(config)
    workers: list[RankProcess] = []
    group: Optional[TPGroup] = None
    leader: Optional[Leader] = None
    try:
        store = dist.TCPStore("127.0.0.1", 0, config.tp_size, is_master=True,
                              timeout=datetime.timedelta(seconds=timeout),
                              wait_for_workers=False)
        for rank in range(1, config.tp_size):
            workers.append(RankProcess(config, TPStart(rank, config.tp_size, store.port)))
        leader = Leader(workers, timeout, collective_timeout(config))
        group = _join_watching(leader, store, config)
        ctx = TPContext(0, config.tp_size, group, commit=LeaderCommit(leader), leader=leader)
    except Exception as e:  # noqa: BLE001 - reported to the frontend, which raises it
        chan.send(SchedulerDied(f"tensor-parallel start failed: {type(e).__name__}: {e}"))
        _stop(leader, workers)
        return
    try:
        with installed(ctx):
            run_loop(config, TPLeaderChannel(chan, leader))
    finally:
        _stop(leader, workers)
        group.shutdown()


def _join_watching(leader: Leader, store: Any, config: EngineConfig) -> TPGroup:
    """Join the group in a helper thread while watching the other ranks: one that exits
    before it joined fails the start at once instead of after the timeout."""
    box: list[Any] = []
    device = rank_device(config, 0)

    def join() -> None:
        try:
            box.append(join_tp_group(store, 0, config.tp_size, device,
                                     start_timeout(config), collective_timeout(config)))
        except BaseException as e:  # noqa: BLE001 - raised below
            box.append(e)

    thread = threading.Thread(target=join, name="tp-group-join", daemon=True)
    thread.start()
    while thread.is_alive():
        leader.check_alive()
        thread.join(0.1)
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _stop(leader: Optional[Leader], workers: list[RankProcess]) -> None:
    if leader is not None:
        leader.stop(timeout=2)
        return
    for w in workers:
        w.proc.kill()


def run_worker(config: EngineConfig, conn: Connection, start: TPStart) -> int:
    """Rank > 0: join the group, build the shard, serve rank 0 until it stops (or goes)."""
    from rollout_engine.runtime.tp_worker import TPWorker, crash_report

    group: Optional[TPGroup] = None
    try:
        timeout = start_timeout(config)
        store = dist.TCPStore("127.0.0.1", start.store_port, start.size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
        group = join_tp_group(store, start.rank, start.size, rank_device(config, start.rank),
                              timeout, collective_timeout(config))
        TPWorker(config, TPContext(start.rank, start.size, group), conn).run()
        return 0
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0   # rank 0 went away
    except Exception as e:  # noqa: BLE001 - told to rank 0, which reports it
        logger.exception("tensor-parallel rank %d failed", start.rank)
        try:
            conn.send(crash_report(start.rank, e))
        except OSError:
            pass
        return 1
    finally:
        if group is not None:
            group.shutdown()
