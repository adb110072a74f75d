"""Harvests and builds spread over Ray actors, one model per actor, with the results of one process.

A `WorkerPool` starts (or joins) a Ray cluster, starts `workers` actors that each load the same model and open
the same store, and hands out one problem (or one text) at a time to whichever actor is free. The results are
the single-process results, bit for bit, because:
- every actor loads the same model spec, dtype and chunk size, and pins torch's thread count to the driver's
  (`--threads`, $KVGRAFT_THREADS or kvgraft's default, as the driver resolved it): the thread count is part of
  the fingerprint (fp32 decode differs between 1 and 2 threads), and Ray would otherwise start each actor with
  as many threads as CPUs it reserved. The count goes in the actor's $KVGRAFT_THREADS, so `import kvgraft`
  pins it before anything computes, and every call pins it again on the OS thread that runs it;
- every actor gets the driver's reproducibility settings (MKL's CNR mode, dynamic threading) in its environment;
- before any work the driver compares each actor's fingerprint with its own and refuses a difference, so an
  actor on another CPU or library version cannot store grafts under other ids;
- problem `index` is solved by `harvest(engine, [item], seed=problem_seed(seed, index))`: the very call, seed and
  tries the single-process `harvest` makes for it;
- results are put back in input order; block packing (`build_blocks`) runs on the driver over them.

Faults: an actor whose process dies is restarted by Ray (`MAX_RESTARTS`) and its unfinished calls are retried
(`MAX_TASK_RETRIES`). Every call can safely run twice: a solve is seeded, and a put is content-addressed and
commits its manifest last, so a killed put leaves at most unreferenced blocks (`kvgraft store gc` removes them),
never a partial graft; a solve retried after its put committed finds its graft already stored (same id).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from kvgraft.core import reproducibility
from kvgraft.core.errors import BadInputError, KvgraftError
from kvgraft.core.fingerprint import Fingerprint
from kvgraft.engine.engine import Engine
from kvgraft.flywheel.datasets import Item
from kvgraft.flywheel.harvest import HarvestRecord, ItemCallback, harvest, import_solutions, problem_seed
from kvgraft.flywheel.prompting import PromptSpec
from kvgraft.store import open_store

RAY_ADDRESS_ENV = "RAY_ADDRESS"
DEFAULT_WORKERS = 2
DEFAULT_CPUS_PER_WORKER = 1.0
OBJECT_STORE_BYTES = 200 * 1024 * 1024
"""The object store of a Ray this module starts: results are small (records, ids), so 200 MB is plenty and fits
a small CI machine."""
MAX_RESTARTS = 3
"""How many times Ray restarts an actor whose process died."""
MAX_TASK_RETRIES = 3
"""How many times Ray retries a call whose actor died while running it."""
CONNECT_TIMEOUT_S = 5.0
"""How long the driver waits for a TCP connection to a cluster's address before giving up (Ray's own retries
take minutes)."""
DEFAULT_GCS_PORT = 6379
DEFAULT_CLIENT_PORT = 10001
"""Ray's ports when an address names none: the cluster's GCS (HOST), Ray Client (ray://HOST)"""
RAY_MISSING = "Ray is not installed; install it with: pip install 'kvgraft[ray]'"


class ClusterError(KvgraftError):
    """The Ray cluster cannot be reached, lacks the CPUs asked for, lost a worker for good, or runs workers whose
    fingerprint differs from this process's."""


@dataclass(frozen=True, kw_only=True)
class RaySettings:
    """Where and how wide to run."""

    address: str | None = None
    """a Ray cluster (`HOST:PORT`, `ray://HOST:PORT`, `auto`); None for $RAY_ADDRESS, else a local Ray started
    here with this machine's CPUs and stopped when done"""
    workers: int = DEFAULT_WORKERS
    cpus_per_worker: float = DEFAULT_CPUS_PER_WORKER
    gpus_per_worker: float = 0.0
    """GPUs Ray reserves per actor (1 when the driver runs on CUDA); an actor with one computes on the GPU Ray
    gives it (`cuda`), whichever index that is on its node"""

    @classmethod
    def of(
        cls, address: str | None, workers: int | None, cpus_per_worker: float | None, device: str = "cpu"
    ) -> RaySettings:
        """Settings from optional values (a command line's).

        Args:
            address: the cluster, or None for $RAY_ADDRESS, else a local Ray.
            workers: how many actors; None for `DEFAULT_WORKERS`.
            cpus_per_worker: CPUs Ray reserves per actor; None for `DEFAULT_CPUS_PER_WORKER`.
            device: the driver's device: on `cuda`/`cuda:N` each actor asks Ray for one GPU.

        Returns:
            The settings.
        """
        return cls(
            address=address,
            workers=DEFAULT_WORKERS if workers is None else workers,
            cpus_per_worker=DEFAULT_CPUS_PER_WORKER if cpus_per_worker is None else cpus_per_worker,
            gpus_per_worker=1.0 if device.startswith("cuda") else 0.0,
        )


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """What each actor loads: everything that makes its engine compute what the driver's computes."""

    model: str
    dtype: str
    chunk_size: int
    store: str
    """an absolute directory or an s3:// URL (a relative path would name another directory on another node)"""
    shared_cache: str | None = None
    allow_env_mismatch: bool = False
    threads: int = 1
    """torch's thread count: part of the fingerprint, so the driver's"""
    device: str = "cpu"
    """the driver's device (cpu, cuda:N, mps): part of the fingerprint too"""

    @classmethod
    def of(
        cls, engine: Engine, store: str | None, shared_cache: str | None = None, allow_env_mismatch: bool = False
    ) -> EngineSpec:
        """The spec of an engine the driver loaded.

        Args:
            engine: the driver's engine (its model spec, dtype and chunk size are copied).
            store: the store as the user gave it (None: the default store), resolved here to an absolute path.
            shared_cache: redis://HOST:PORT/DB of the shared block cache, or None.
            allow_env_mismatch: as the driver's engine was loaded.

        Returns:
            The spec, with this process's torch thread count.
        """
        return cls(
            model=engine.model_name,
            dtype=engine.fingerprint.model["dtype"],
            chunk_size=engine.schedule.chunk_size,
            store=resolve_store(store),
            shared_cache=shared_cache,
            allow_env_mismatch=allow_env_mismatch,
            threads=reproducibility.current_threads(),
            device=str(engine.model.device),
        )


def resolve_store(store: str | None) -> str:
    """The store every worker can open by the same name.

    Args:
        store: a directory, an s3:// URL, or None for the default store.

    Returns:
        The directory made absolute, or the URL.
    """
    opened = open_store(store)
    return str(opened.directory.resolve()) if opened.directory is not None else opened.location


# --- the actor (runs in a Ray worker process) ---------------------------------------------------------------------


class Worker:
    """One model and one store in a Ray actor. Errors kvgraft raises on purpose are returned, not raised, so that
    the driver re-raises them as they are (Ray would wrap them in its own exception and traceback)."""

    def __init__(self, spec: EngineSpec, on_ray_gpu: bool = False) -> None:
        self.threads = spec.threads
        reproducibility.set_threads(spec.threads)  # before the model computes anything: part of the fingerprint
        self.engine: Engine | None = None
        self.failure: KvgraftError | None = None
        try:
            self.engine = Engine.load(
                spec.model,
                dtype=spec.dtype,
                # Ray sets CUDA_VISIBLE_DEVICES to the GPU it reserved: that one is `cuda` here.
                device="cuda" if on_ray_gpu else spec.device,
                chunk_size=spec.chunk_size,
                store=spec.store,
                allow_environment_mismatch=spec.allow_env_mismatch,
                shared_cache=spec.shared_cache,
            )
        except KvgraftError as exc:
            self.failure = exc

    def _engine(self) -> Engine:
        # OpenMP keeps the count per OS thread, and Ray need not run every call on the thread that ran __init__.
        reproducibility.set_threads(self.threads)
        if self.engine is None:
            raise self.failure or ClusterError("the worker has no engine")
        return self.engine

    def pid(self) -> int:
        """Returns: this actor's process id (tests kill it)."""
        return os.getpid()

    def fingerprint(self) -> dict[str, Any] | KvgraftError:
        """Returns: the engine's fingerprint as JSON, or the error that kept the engine from loading."""
        try:
            return self._engine().fingerprint.to_json()
        except KvgraftError as exc:
            return exc

    def solve(
        self,
        item: Item,
        attempts: int,
        budget: int,
        temperature: float,
        seed: int,
        check: bool,
        prompt: PromptSpec | None = None,
    ) -> HarvestRecord | KvgraftError:
        """One problem, exactly as `harvest` solves it with this seed (`seed` is already the problem's own)."""
        try:
            engine = self._engine()
            return harvest(engine, [item], attempts, budget, temperature, seed, check=check, prompt=prompt)[0]
        except KvgraftError as exc:
            return exc

    def import_solution(
        self, item: Item, check: bool, prompt: PromptSpec | None = None
    ) -> HarvestRecord | KvgraftError:
        """One item's own worked solution, exactly as `import_solutions` stores it."""
        try:
            return import_solutions(self._engine(), [item], check=check, prompt=prompt)[0]
        except KvgraftError as exc:
            return exc

    def put(self, text: str, metadata: dict[str, Any], after: str | None, check: bool) -> dict[str, Any] | KvgraftError:
        """Build and store one graft; returns `PutResult.to_json()`."""
        try:
            return self._engine().put(text, metadata, after=after, check=check).to_json()
        except KvgraftError as exc:
            return exc


# --- the driver ---------------------------------------------------------------------------------------------------


def import_ray() -> Any:
    """Returns: the `ray` module; raises BadInputError saying how to install it when it is missing."""
    try:
        import ray
    except ImportError:
        raise BadInputError(RAY_MISSING) from None
    return ray


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Fail fast when a cluster address does not answer (Ray itself retries for minutes).

    Args:
        address: `HOST[:PORT]` or `ray://HOST[:PORT]`; `auto` and `local` are left to Ray.
        timeout_s: the longest wait for the TCP connection.

    Raises:
        ClusterError: nothing accepts a connection at the address within `timeout_s`.
    """
    if address in ("auto", "local"):
        return
    client = address.startswith("ray://")
    target = address.removeprefix("ray://")
    default = DEFAULT_CLIENT_PORT if client else DEFAULT_GCS_PORT
    host, _, port = target.rpartition(":") if ":" in target.rsplit("]", 1)[-1] else (target, "", str(default))
    if not host or not port.isdigit():
        raise BadInputError(f"Ray address {address!r} is not HOST:PORT or ray://HOST:PORT")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise ClusterError(
            f"cannot reach the Ray cluster at {address} ({reason}; waited at most {timeout_s:g} s)"
        ) from None


@contextmanager
def ray_session(settings: RaySettings) -> Iterator[Any]:
    """Ray, connected: the session already open in this process, the cluster at the address, or a local Ray.

    A Ray started here (no address and none in $RAY_ADDRESS) uses this machine's CPUs, no dashboard, a small
    object store, and is shut down on exit, its processes with it; a session that was already open is left open.

    Args:
        settings: the address (None: $RAY_ADDRESS, else a local Ray).

    Yields:
        The `ray` module.
    """
    ray = import_ray()
    address = settings.address or os.environ.get(RAY_ADDRESS_ENV) or None
    if address is not None:
        check_reachable(address)
    if ray.is_initialized():
        yield ray
        return
    # Joining a cluster takes only these; sizing and the dashboard are the cluster's own.
    options: dict[str, Any] = {"address": address or "local", "log_to_driver": False, "logging_level": logging.ERROR}
    if address is None:
        options |= {
            "num_cpus": os.cpu_count() or 1,
            "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": False,
        }
    try:
        ray.init(**options)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as exc:
        if address is None:
            raise ClusterError(f"cannot start a local Ray: {exc}") from None
        # Ray 2.59+ clusters started with `ray start` require a token that a driver sends only in token mode.
        raise ClusterError(
            f"cannot connect to the Ray cluster at {address}: {exc} (a cluster with token authentication needs "
            "RAY_AUTH_MODE=token, and its token, in this process's environment too)"
        ) from None
    try:
        yield ray
    finally:
        ray.shutdown()


class WorkerPool:
    """Actors that each hold the same model and store; work goes to whichever actor is free.

    >>> with WorkerPool.open(EngineSpec.of(engine, None), RaySettings(workers=2), engine.fingerprint) as pool:
    ...     records = pool.harvest(items, attempts=4, budget=160)           # doctest: +SKIP
    """

    def __init__(self, ray: Any, actors: list[Any]) -> None:
        self.ray = ray
        self.actors = actors

    @classmethod
    @contextmanager
    def open(cls, spec: EngineSpec, settings: RaySettings, expect: Fingerprint) -> Iterator[WorkerPool]:
        """Start the actors, check their fingerprints, and stop them (and a Ray started here) on exit.

        Args:
            spec: what every actor loads.
            settings: where and how many.
            expect: the driver's fingerprint; every actor must compute under exactly this one.

        Yields:
            The pool.

        Raises:
            BadInputError: Ray is missing, or the settings are out of range.
            ClusterError: the cluster is unreachable or too small, or an actor's fingerprint differs.
        """
        if settings.workers < 1 or settings.cpus_per_worker <= 0:
            raise BadInputError("a Ray pool needs at least 1 worker and more than 0 CPUs per worker")
        with ray_session(settings) as ray:
            _check_capacity(ray, settings)
            env = {name: os.environ[name] for name in reproducibility.ENVIRONMENT if name in os.environ}
            env[reproducibility.THREADS_ENV] = str(spec.threads)
            remote = ray.remote(Worker).options(
                num_cpus=settings.cpus_per_worker,
                num_gpus=settings.gpus_per_worker,
                max_restarts=MAX_RESTARTS,
                max_task_retries=MAX_TASK_RETRIES,
                runtime_env={"env_vars": env},
            )
            actors = [remote.remote(spec, settings.gpus_per_worker > 0) for _ in range(settings.workers)]
            try:
                pool = cls(ray, actors)
                pool._check_fingerprints(expect)
                yield pool
            finally:
                for actor in actors:
                    with suppress(Exception):  # already dead: nothing to stop
                        ray.kill(actor, no_restart=True)

    def _get(self, ref: Any) -> Any:
        """A call's value; a kvgraft error the actor returned is raised here, a lost actor as ClusterError."""
        try:
            value = self.ray.get(ref)
        except self.ray.exceptions.RayActorError as exc:
            raise ClusterError(
                f"a Ray worker could not start, or died more than {MAX_RESTARTS} times: {exc.error_msg}"
            ) from None
        if isinstance(value, KvgraftError):
            raise value
        return value

    def _check_fingerprints(self, expect: Fingerprint) -> None:
        wanted = expect.to_json()
        for number, actor in enumerate(self.actors):
            got = self._get(actor.fingerprint.remote())
            differences = _differences(wanted, got)
            if differences:
                raise ClusterError(
                    f"Ray worker {number} computes under another fingerprint than this process "
                    f"({'; '.join(differences)}): its grafts would not be the ones this process builds"
                )

    def pids(self) -> list[int]:
        """Returns: each actor's process id, in actor order."""
        return [self._get(actor.pid.remote()) for actor in self.actors]

    def map(self, count: int, call: Callable[[Any, int], Any], on_item: ItemCallback | None = None) -> list[Any]:
        """Run `call(actor, index)` for every index, one at a time per actor, on whichever actor is free.

        Args:
            count: how many calls.
            call: submits call `index` to `actor` and returns its object ref.
            on_item: progress callback, called as each result arrives (items done, items in all).

        Returns:
            The results, in index order.
        """
        results: list[Any] = [None] * count
        upcoming = iter(range(count))
        pending: dict[Any, tuple[int, Any]] = {}

        def feed(actor: Any) -> None:
            index = next(upcoming, None)
            if index is not None:
                pending[call(actor, index)] = (index, actor)

        for actor in self.actors:
            feed(actor)
        done = 0
        while pending:
            (ready,), _ = self.ray.wait(list(pending), num_returns=1)
            index, actor = pending.pop(ready)
            results[index] = self._get(ready)
            done += 1
            if on_item is not None:
                on_item(done, count)
            feed(actor)
        return results

    def harvest(
        self,
        items: Sequence[Item],
        attempts: int = 4,
        budget: int = 160,
        temperature: float = 0.7,
        seed: int = 0,
        on_item: ItemCallback | None = None,
        check: bool = True,
        prompt: PromptSpec | None = None,
    ) -> list[HarvestRecord]:
        """`kvgraft.flywheel.harvest.harvest`, one problem per call, spread over the actors.

        Args:
            items: the problems, with gold answers.
            attempts, budget, temperature, seed, check, prompt: as in `harvest` (problem i gets
                `problem_seed(seed, i)` there and here).
            on_item: progress callback, called as each problem's record arrives.

        Returns:
            One record per item, in order: the single-process records (timings aside).
        """

        def call(actor: Any, index: int) -> Any:
            seed_i = problem_seed(seed, index)
            return actor.solve.remote(items[index], attempts, budget, temperature, seed_i, check, prompt)

        return self.map(len(items), call, on_item)

    def import_solutions(
        self,
        items: Sequence[Item],
        on_item: ItemCallback | None = None,
        check: bool = True,
        prompt: PromptSpec | None = None,
    ) -> list[HarvestRecord]:
        """`kvgraft.flywheel.harvest.import_solutions`, one item per call, spread over the actors.

        Returns:
            One record per item, in order.
        """

        def call(actor: Any, index: int) -> Any:
            return actor.import_solution.remote(items[index], check, prompt)

        return self.map(len(items), call, on_item)

    def put(
        self,
        texts: Sequence[tuple[str, dict[str, Any]]],
        after: str | None = None,
        check: bool = False,
        on_item: ItemCallback | None = None,
    ) -> list[dict[str, Any]]:
        """`Engine.put` of every (text, metadata), spread over the actors.

        Texts that share leading blocks may compute them on two actors at once: both get the same bytes, so
        either write is the block, and the graft ids are those of a sequential build.

        Returns:
            `PutResult.to_json()` per text, in order (`reused_blocks` depends on which actor got there first).
        """

        def call(actor: Any, index: int) -> Any:
            text, metadata = texts[index]
            return actor.put.remote(text, metadata, after, check)

        return self.map(len(texts), call, on_item)


def _check_capacity(ray: Any, settings: RaySettings) -> None:
    """Refuse a pool the cluster cannot hold: Ray would otherwise wait forever for the CPUs or GPUs."""
    resources = ray.cluster_resources()
    for resource, per_worker, fewer in (
        ("CPU", settings.cpus_per_worker, "ask for fewer workers or fewer CPUs per worker"),
        ("GPU", settings.gpus_per_worker, "ask for fewer workers"),
    ):
        have = float(resources.get(resource, 0))
        wanted = settings.workers * per_worker
        if wanted > have:
            raise ClusterError(
                f"{settings.workers} Ray workers of {per_worker:g} {resource}(s) need {wanted:g} {resource}s; "
                f"the cluster has {have:g}: {fewer}"
            )


def _differences(wanted: dict[str, Any], got: dict[str, Any], path: str = "") -> list[str]:
    """`section.key wanted vs got` for every leaf of two fingerprints' JSON that differs."""
    found = []
    for key in sorted(set(wanted) | set(got)):
        a, b = wanted.get(key), got.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found += _differences(a, b, f"{path}{key}.")
        elif a != b:
            found.append(f"{path}{key} {a!r} vs {b!r}")
    return found
