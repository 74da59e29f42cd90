"""Environments for asyncio code: every env step runs in a worker process, never on the loop.

Worker processes (not threads) host the environments because TextWorld's PDDL translation
rewrites ``sys.argv`` and swaps ``sys.stdout``, and the speed-up caches patch modules. Each
worker holds many environments (one per :class:`AsyncTextEnv`) and serves requests in order;
an env's requests therefore never overlap, while envs on different workers step in parallel.
Replies come back through the event loop's reader callback on the worker's pipe, so waiting
costs the loop nothing. A worker that dies fails its pending calls with :class:`EnvWorkerError`
(the episode it was serving fails once); the next call of any of its environments starts a
replacement worker, after a backoff, up to ``max_restarts`` times in the pool's life (or within any
``restart_window_s``), after which calls raise :class:`EnvPoolExhausted` (the owner should stop rather
than fail episodes for ever).

    async with AsyncEnvPool(workers=2, max_steps=50) as pool:
        env = pool.env()
        first = await env.reset(game)
        result = await env.step(first.expert_action)
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import select
import signal
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from comap_async.envs.base import GameInfo, RestoreDiverged, StepResult
from comap_async.errors import CommandError

_START_TIMEOUT_S = 120.0
_STARTS_AFRESH = frozenset({"reset", "restore", "close"})
"""The calls that need no earlier state in the worker: after a replacement, any other call (a step
of a game that lived in the dead worker) fails with the worker's death named, once."""


class EnvWorkerError(RuntimeError):
    """An environment call failed in its worker process (the message carries the remote traceback;
    ``kind`` names the remote exception's class)."""

    def __init__(self, message: str, kind: str = "") -> None:
        super().__init__(message)
        self.kind = kind


class EnvPoolExhausted(CommandError, EnvWorkerError):
    """Environment workers kept dying: the pool's restart budget is spent."""


def _worker_main(conn: Connection, env_name: str, env_kwargs: dict[str, Any]) -> None:
    # one torch/BLAS thread is the project rule; the env needs none, but imports may start pools
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The owning process decides when a worker ends (None on the pipe, or EOF when it dies):
    # honcho signals the whole process group, and a worker killed under a running episode would
    # fail that episode while the actor is still flushing it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from comap_async.envs import create_env

    envs: dict[int, Any] = {}
    conn.send(("ready", os.getpid()))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            break
        if request is None:
            break
        req_id, env_id, method, args = request
        try:
            if method == "close":
                env = envs.pop(env_id, None)
                result = env.close() if env is not None else None
            else:
                env = envs.get(env_id)
                if env is None:
                    env = envs[env_id] = create_env(env_name, **env_kwargs)
                result = getattr(env, method)(*args)
            reply = (req_id, True, result)
        except Exception as exc:  # noqa: BLE001 - sent to the caller, who raises it
            reply = (req_id, False, (type(exc).__name__, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        try:
            conn.send(reply)
        except OSError:  # the owner is gone (killed): nobody to answer
            break
    for env in envs.values():
        env.close()


class _Worker:
    def __init__(self, ctx: Any, env_name: str, env_kwargs: dict[str, Any]) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child, env_name, env_kwargs), daemon=True)
        self.process.start()
        child.close()
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.dead: str | None = None

    async def wait_ready(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            ready = await asyncio.wait_for(loop.run_in_executor(None, self.conn.recv), _START_TIMEOUT_S)
        except EOFError:
            self.process.join(5)
            raise EnvWorkerError(
                f"environment worker exited at start (exit code {self.process.exitcode}); with the spawn start "
                "method the main script must guard its entry point with `if __name__ == '__main__':`"
            ) from None
        if ready[0] != "ready":
            raise EnvWorkerError(f"worker sent {ready!r} instead of ready")
        self.loop = loop
        # Connection.poll() builds a selector per call (tens of us, several times per step);
        # one poll object answers "is another reply waiting?" in about a microsecond
        self._more = select.poll()
        self._more.register(self.conn.fileno(), select.POLLIN)
        loop.add_reader(self.conn.fileno(), self._on_readable)
        # uvloop (the actors' loop) makes a watched descriptor non-blocking; a reply bigger than
        # the socket buffer (a ScienceWorld state lists up to ~2,900 valid actions) then arrives in
        # parts and recv() would fail mid-message. Blocking, recv() waits for the rest of a reply
        # the worker is already writing.
        os.set_blocking(self.conn.fileno(), True)

    def _on_readable(self) -> None:
        try:
            while True:
                req_id, ok, payload = self.conn.recv()
                fut = self.pending.pop(req_id, None)
                if fut is not None and not fut.done():  # else the caller was cancelled: no one to tell
                    if ok:
                        fut.set_result(payload)
                    else:
                        fut.set_exception(EnvWorkerError(payload[1], kind=payload[0]))
                if not self._more.poll(0):
                    return
        except (EOFError, OSError) as exc:
            self._fail_all(
                f"environment worker pid {self.process.pid} died "
                f"({type(exc).__name__}, exit code {self.process.exitcode})"
            )

    def _fail_all(self, reason: str) -> None:
        self.dead = reason
        if self.loop is not None:
            self.loop.remove_reader(self.conn.fileno())
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(EnvWorkerError(reason))
        self.pending.clear()

    def call(self, req_id: int, env_id: int, method: str, args: tuple[Any, ...]) -> asyncio.Future[Any]:
        if self.dead:
            raise EnvWorkerError(self.dead)
        assert self.loop is not None, "worker not started"
        fut = self.loop.create_future()
        self.pending[req_id] = fut
        # requests are a few hundred bytes: the pipe buffer takes them without blocking
        self.conn.send((req_id, env_id, method, args))
        return fut

    def detach(self) -> None:
        """Stop watching the pipe and fail calls still waiting (on the loop's thread, before :meth:`stop`)."""
        if not self.dead:
            self._fail_all("environment pool closed")

    def ask_to_stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass  # already gone: nothing to tell it

    def stop(self, timeout: float = 5.0) -> None:
        """Wait for the worker to end after :meth:`ask_to_stop`; kill it after ``timeout``."""
        self.process.join(timeout)
        self.kill()

    def kill(self) -> None:
        """End it now (stuck in a step, it ignores SIGTERM: see _worker_main) and reap it; SIGKILL
        takes effect at once, so the join is short."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        if self.loop is not None:  # else a start-up thread may still be reading it; it reads EOF now
            self.conn.close()


class AsyncTextEnv:
    """One environment living in a worker process; its calls are awaited in order."""

    def __init__(self, pool: "AsyncEnvPool", worker: _Worker, env_id: int) -> None:
        self._pool, self._worker, self.env_id = pool, worker, env_id
        self._lock = asyncio.Lock()

    async def _call(self, method: str, *args: Any) -> Any:
        async with self._lock:
            if self._worker.dead:  # its environments went with it: this one starts afresh elsewhere
                died, self._worker = self._worker.dead, await self._pool._replacement(self._worker)
                if method not in _STARTS_AFRESH:  # the game it was in is gone with the dead worker
                    raise EnvWorkerError(f"{died}; the game this environment was playing is lost: reset it")
            try:
                return await self._worker.call(next(self._pool._req_ids), self.env_id, method, args)
            except EnvWorkerError as exc:
                if exc.kind == RestoreDiverged.__name__:  # the same type as in-process: callers catch one
                    raise RestoreDiverged(str(exc).split("\n", 1)[0]) from None
                raise

    async def reset(self, game: GameInfo | str) -> StepResult:
        return await self._call("reset", game)

    async def step(self, action: str) -> StepResult:
        return await self._call("step", action)

    async def restore(self, game: GameInfo | str, actions: Sequence[str]) -> StepResult:
        """The state after ``actions`` from a fresh reset of ``game`` (restore by replay)."""
        return await self._call("restore", game, list(actions))

    async def walkthrough(self) -> list[str]:
        """The current game's recorded winning command sequence (after ``reset``)."""
        return await self._call("walkthrough")

    async def close(self) -> None:
        await self._call("close")


class AsyncEnvPool:
    """Worker processes hosting environments; :meth:`env` hands them out round-robin."""

    def __init__(
        self,
        workers: int = 1,
        env_name: str = "alfworld",
        start_method: str = "spawn",
        max_restarts: int = 5,
        restart_window_s: float | None = None,
        **env_kwargs: Any,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.num_workers = workers
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s  # None: the budget is the pool's life's
        self.restarts = 0  # dead workers replaced so far
        self._restart_times: list[float] = []  # when each replacement started (monotonic)
        self._replaced: dict[int, _Worker] = {}  # id of a dead worker -> the worker that took its place
        self._restart_lock = asyncio.Lock()
        self.env_name = env_name
        self.env_kwargs = env_kwargs
        self._ctx = mp.get_context(start_method)
        self._workers: list[_Worker] = []
        self._req_ids = itertools.count()
        self._env_ids = itertools.count()

    async def start(self) -> "AsyncEnvPool":
        self._workers = [_Worker(self._ctx, self.env_name, self.env_kwargs) for _ in range(self.num_workers)]
        try:
            await asyncio.gather(*(w.wait_ready() for w in self._workers))
        except BaseException:  # cancelled or failed: no worker may outlive a pool nobody will close
            workers, self._workers = self._workers, []
            for w in workers:
                w.detach()
                w.kill()
            raise
        return self

    async def _replacement(self, dead: _Worker) -> _Worker:
        """The worker that takes ``dead``'s place (started once, however many of its envs ask)."""
        async with self._restart_lock:
            if id(dead) in self._replaced:
                return self._replaced[id(dead)]
            if dead not in self._workers:
                raise EnvWorkerError("environment pool closed")
            now = time.monotonic()
            if self.restart_window_s is not None:
                self._restart_times = [t for t in self._restart_times if now - t < self.restart_window_s]
            recent = len(self._restart_times)
            if recent >= self.max_restarts:
                within = "" if self.restart_window_s is None else f" within {self.restart_window_s:g} s"
                raise EnvPoolExhausted(
                    f"{self.env_name} environment workers died {recent + 1} times{within} "
                    f"(restart budget {self.max_restarts}); last: {dead.dead}"
                )
            self._restart_times.append(now)
            await asyncio.sleep(min(0.5 * 2**recent, 8.0))  # a crash loop must not spin
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, dead.stop, 1.0)  # reap it (no zombie)
            fresh = _Worker(self._ctx, self.env_name, self.env_kwargs)
            await fresh.wait_ready()
            self._workers[self._workers.index(dead)] = fresh
            self._replaced[id(dead)] = fresh
            self.restarts += 1
            return fresh

    def env(self) -> AsyncTextEnv:
        if not self._workers:
            raise RuntimeError("AsyncEnvPool.start() first (or use `async with`)")
        env_id = next(self._env_ids)
        return AsyncTextEnv(self, self._workers[env_id % len(self._workers)], env_id)

    async def close(self, timeout: float = 5.0) -> None:
        """Stop the workers; one still busy after ``timeout`` (in a long reset, say) is killed, and
        so is every one left when the close itself is cancelled: a shutdown that will not wait
        (the evaluator's, under honcho's 5 s grace) must not leave a worker or a thread behind."""
        workers, self._workers = self._workers, []
        for w in workers:
            w.detach()
            w.ask_to_stop()  # all at once: they wind down in parallel
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while any(w.process.is_alive() for w in workers) and loop.time() < deadline:
                await asyncio.sleep(0.02)
        finally:
            for w in workers:
                w.kill()

    async def __aenter__(self) -> "AsyncEnvPool":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
