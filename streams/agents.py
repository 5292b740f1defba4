"""faust's agents, tasks, timers and signal handlers of the worker: each only calls the worker.

faust declares an agent on an app instance (``@app.agent``), and the app is built from the
settings read in the entry point (``streams.worker``), so the agents cannot sit at module
level without a module-level app configured at import time. They are declared here, in one
function that only wires faust's hooks to ``streams.app.Worker``: everything they do is a
method of the worker (or of its ``BatchCommit``), addressable and testable without faust.

A Redis error is a retry, never a crash, in each of them (``streams.retry``): an agent
commits its batch again after a backoff until Redis has it, the drift timer skips its
ticks until the backoff has passed, and the keeper's loop tries again on its next tick.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import faust

from spendgate.streams.batching import batches
from spendgate.streams.retry import StoreRetry, commit_until_written

if TYPE_CHECKING:
    from spendgate.streams.app import Worker

__all__ = ["declare_agents"]


def declare_agents(app: faust.App, worker: Worker) -> None:
    """Declare on ``app`` the agents, tasks, timers and signal handlers of ``worker``."""
    size, linger_s = worker.settings.batch_size, worker.settings.batch_linger_s

    def owned() -> Any:
        return app.consumer.assignment()

    def rebalancing() -> bool:
        return bool(getattr(app, "rebalancing", False))

    @app.task  # type: ignore[untyped-decorator]
    async def policy_tail() -> None:
        await worker.book.run()

    @app.task  # type: ignore[untyped-decorator]
    async def keep_redis() -> None:
        await worker.keeper.run()

    @app.timer(interval=1.0)  # type: ignore[untyped-decorator]
    async def drift_check() -> None:
        await worker.drift.tick()

    @app.timer(interval=5.0)  # type: ignore[untyped-decorator]
    async def dedupe_figures() -> None:
        worker.dedupe_figures()

    @app.on_partitions_assigned.connect
    def forget_positions(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        # faust sends one argument: the whole new assignment (after the revocation).
        (assigned,) = args
        worker.on_assigned(assigned)

    @app.on_rebalance_complete.connect
    def note_recovered(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        # Sent once the tables are recovered for this generation (before the streams
        # resume): the windows of moved partitions can be restored from them now.
        worker.keeper.on_recovered()

    @app.on_before_shutdown.connect
    async def close_offsets(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        await worker.keeper.close()

    @app.agent(worker.topics.usage, concurrency=1)
    async def split(stream: faust.StreamT[bytes]) -> None:
        await worker.policies_ready()
        commit = worker.usage_commit(stream)
        retry = StoreRetry("split")  # also the agent's name in its liveness
        async for events in batches(stream, size, linger_s):
            await commit_until_written(
                commit.run,
                events,
                retry,
                owned=owned,
                rebalancing=rebalancing,
                liveness=worker.liveness,
                bound_hit=worker.bound_hit,
            )

    @app.agent(worker.topics.keyed, concurrency=1)
    async def account(stream: faust.StreamT[bytes]) -> None:
        commit = worker.keyed_commit(stream)
        retry = StoreRetry("account")
        async for events in batches(stream, size, linger_s):
            await commit_until_written(
                commit.run,
                events,
                retry,
                owned=owned,
                rebalancing=rebalancing,
                liveness=worker.liveness,
                bound_hit=worker.bound_hit,
            )
