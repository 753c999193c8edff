"""The forward pass in a process of its own: ``TorchEngine(executor="process")``.

>>> # proc = EngineProcess(model_dir, device="cpu", dtype="auto")
>>> # info = proc.start()                  # on the engine's thread: spawn, load, cfg back
>>> # runner = ProcessRunner(proc, kv, info, rows)   # attach/clear/detach like ModelRunner
>>> # tokens = await runner.submit(plan)       # on the event loop: one step there

Why: on a Python-bound forward (a small model on CPU; kernel launches on a GPU) the engine's
thread and the event loop take turns on the GIL, so every microsecond the loop spends delivering
tokens is one the next step waits for. In a process of its own the forward runs beside the loop.

What crosses, and when:

- at start, nothing but the checkpoint's path: the engine process loads the weights itself and
  answers the config, device and dtype (this process never holds the weights);
- once the pool is open, the pool's L1 arrays (moved to shared memory in place, so every view of
  them here stays valid and sees what the engine process writes) and a shared staging array for
  embedding rows, as file descriptors over a socket pair (SCM_RIGHTS);
- per step, one message of plain values and one reply: the ``StepItem``s (embedding rows copied
  into the staging array, the item saying where), the L1 block ids of sequences whose pages
  changed, the sampling parameters of new sampled requests, the requests gone; the reply is the
  sampled tokens, or the error of the forward pass.

The engine process owns the model and the sampling RNGs; this process owns everything else
(scheduling, pages, the pool and its metadata), so the pool never learns there is a second
process. The engine process exits when its pipe closes: at ``stop``, and when this process
dies, SIGKILL included.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from omniflow.compute._config import ModelConfig
from omniflow.compute._errors import EngineError, EngineProcessError, ModelLoadError
from omniflow.compute._kv import KvCache, L1Pages
from omniflow.compute._request import SamplingParams
from omniflow.compute._runner import ModelRunner, StepItem, step_items
from omniflow.compute._scheduler import StepPlan
from omniflow.compute._sequence import Sequence

__all__ = ["EngineProcess", "ModelInfo", "ProcessRunner"]

#: Seconds ``close`` waits for the engine process to exit before it is killed.
CLOSE_TIMEOUT = 10.0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What this process knows of the model the engine process loaded."""

    cfg: ModelConfig  #: the checkpoint's config
    device: torch.device  #: where the weights and the KV pages live
    dtype: torch.dtype  #: the weights' (and so the KV pages') dtype


class EngineProcess:
    """The engine's process: spawned and loaded by ``start``, ended by ``close``.

    A fresh interpreter (``python -c`` running ``main``): never a fork of this process with its
    threads and event loop, and unlike ``multiprocessing``'s spawn it never re-imports the
    caller's script, so no ``if __name__ == "__main__":`` guard is needed. Two socket pairs
    connect it: ``ctl`` carries the messages (pickled, our own values only), ``fds`` the
    shared arrays' file descriptors, once each."""

    def __init__(self, model_dir: Path, device: str | torch.device, dtype: str | torch.dtype):
        self.model_dir = model_dir  #: the checkpoint the engine process loads
        self.device, self.dtype = device, dtype  #: as asked (resolved there)
        self._conn: Connection | None = None  #: our end of ``ctl``
        self._fds: socket.socket | None = None  #: our end of ``fds``
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ModelInfo:
        """Spawn the engine process and wait until it loaded the weights (blocking: call it from
        the engine's thread). A load error there is raised here with its type and message."""
        ctl, ctl_child = socket.socketpair()
        fds, fds_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _ENTRY, str(ctl_child.fileno()), str(fds_child.fileno())],
                pass_fds=(ctl_child.fileno(), fds_child.fileno()),
                stdin=subprocess.DEVNULL,
                env=_child_env(),
            )
        finally:
            ctl_child.close()
            fds_child.close()
        self._conn, self._fds = Connection(ctl.detach()), fds
        atexit.register(self.close)
        try:
            threads = torch.get_num_threads()
            self.send(("load", str(self.model_dir), str(self.device), str(self.dtype), threads))
            reply = self._recv("loading the weights")
        except BaseException:
            self.close()
            raise
        if reply[0] == "error":
            self.close()
            _, kind, message, path = reply
            if kind == "ModelLoadError":
                raise ModelLoadError(message, path=path)
            raise EngineError(f"the engine process could not load {self.model_dir}: {message}")
        _, cfg, device, dtype = reply
        return ModelInfo(cfg, torch.device(device), getattr(torch, dtype))

    def share(self, name: str, arrays: list[torch.Tensor]) -> None:
        """Move ``arrays`` (CPU) to shared memory in place and hand them to the engine process
        as ``name``: every view of them here stays valid and sees what it writes."""
        handles, fds = [], []
        for t in arrays:
            # torch.multiprocessing's own mechanism (its file_descriptor strategy), without its
            # resource-sharer thread: the storage moves to an unlinked shm file in place
            fd, size = t.untyped_storage()._share_fd_cpu_()
            handles.append(
                (
                    size,
                    str(t.dtype).removeprefix("torch."),
                    t.storage_offset(),
                    tuple(t.shape),
                    t.stride(),
                )
            )
            fds.append(fd)
        if self._fds is None:
            raise EngineProcessError(f"the engine process for {self.model_dir} was closed")
        try:
            socket.send_fds(self._fds, [pickle.dumps((name, handles))], fds)
        except OSError as exc:
            raise self._gone("taking shared arrays") from exc

    def send(self, message: Any) -> None:
        """One message to the engine process."""
        if self._conn is None:
            raise EngineProcessError(f"the engine process for {self.model_dir} was closed")
        try:
            self._conn.send(message)
        except (OSError, ValueError) as exc:
            raise self._gone("taking a message") from exc

    def recv(self) -> Any:
        """The engine process's reply to the last step (call it once the pipe is readable)."""
        return self._recv("running a step")

    def fileno(self) -> int:
        """Our end of ``ctl``, for an event loop's reader."""
        if self._conn is None:
            raise EngineProcessError(f"the engine process for {self.model_dir} was closed")
        return self._conn.fileno()

    def _recv(self, doing: str) -> Any:
        if self._conn is None:
            raise EngineProcessError(f"the engine process for {self.model_dir} was closed")
        try:
            return self._conn.recv()
        except (EOFError, OSError) as exc:
            raise self._gone(doing) from exc

    def _gone(self, doing: str) -> EngineProcessError:
        code = None
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(1.0)  # it closed its end: it is exiting, if not gone already
            code = self._proc.returncode
        how = "is still running" if code is None else f"exited with code {code}"
        return EngineProcessError(
            f"the engine process for {self.model_dir} {how} and stopped answering while "
            f"{doing}; stop this engine and start a new one"
        )

    def close(self) -> None:
        """End the engine process: close the pipes (it exits on EOF), then wait, then kill.
        Idempotent; also run at interpreter exit."""
        atexit.unregister(self.close)
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
            conn.close()
        if self._fds is not None:
            self._fds.close()
            self._fds = None
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.wait(CLOSE_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    @property
    def pid(self) -> int | None:
        """The engine process's pid while it runs (observability, tests)."""
        return None if self._proc is None else self._proc.pid


def _child_env() -> dict[str, str]:
    """This process's environment without omniflow's secrets (the API key, the cluster key):
    the engine process reads weights and steps, and needs none of them."""
    return {k: v for k, v in os.environ.items() if not (k.startswith("OMNIFLOW_") and "KEY" in k)}


class ProcessRunner:
    """``ModelRunner``'s interface, carried out by the engine process.

    Driven from the event loop alone: ``submit`` writes the step's message and returns a future
    that the loop's reader on the pipe resolves when the reply comes, so a step costs one
    wake-up on each side (no thread in between). What changed since the last step (pages,
    sampling parameters, requests gone) rides with the next step's message."""

    def __init__(self, proc: EngineProcess, kv: KvCache, info: ModelInfo, max_rows: int) -> None:
        self.proc = proc  #: the engine process
        self.kv = kv  #: this process's pool seam (block ids)
        self._blocks: dict[str, list[int]] = {}  #: request_id -> L1 ids not yet sent
        self._sampling: dict[str, SamplingParams] = {}  #: request_id -> params not yet sent
        self._gone: list[str] = []  #: requests to forget, not yet sent
        self._pending: asyncio.Future[list[int | None]] | None = None  #: the running step
        self._dead: EngineProcessError | None = None  #: why the engine process is gone
        self._loop: asyncio.AbstractEventLoop | None = None  #: where the reader is registered
        stores = kv.stores()
        if stores is None:
            raise EngineError(
                f"pool {getattr(kv.pool, 'name', '?')!r} has no local L1 arrays; "
                "executor='process' needs an of.ParamsPool (TorchEngine.pool(...))"
            )
        self.info = info  #: the model as the engine process loaded it
        proc.share("stores", [t for kv_pair in stores for t in kv_pair])
        #: embedding rows of a step, copied here for the engine process to read (a step
        #: computes at most ``max_step_tokens`` positions, so at most that many rows)
        self._staging = torch.empty((max_rows, info.cfg.hidden_size), dtype=info.dtype)
        proc.share("staging", [self._staging])

    def attach(self, seq: Sequence) -> None:
        block = self.kv.block(seq.slots)
        if block is None:
            raise EngineError(
                f"request {seq.request_id!r}: some of its pages are not in this pool's l1 "
                "(pulled from another process in place); executor='process' reads l1 only, "
                "run this engine with executor='thread'"
            )
        self._blocks[seq.request_id] = block.tolist()

    def sample_with(self, request_id: str, params: SamplingParams) -> None:
        self._sampling[request_id] = params

    def detach(self, request_id: str) -> None:
        self._blocks.pop(request_id, None)
        self._sampling.pop(request_id, None)
        self._gone.append(request_id)

    def detach_pages(self, request_id: str) -> None:
        self._blocks.pop(request_id, None)  # the next attach sends the new pages whole

    def submit(self, plan: StepPlan) -> asyncio.Future[list[int | None]]:
        """Start ``plan`` in the engine process; the future holds its sampled tokens, or
        ``EngineError`` (the forward failed) or ``EngineProcessError`` (the process is gone)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[int | None]] = loop.create_future()
        if self._pending is not None and not self._pending.done():  # pragma: no cover
            raise AssertionError("a step is already running in the engine process")
        if self._loop is None and self._dead is None:
            self._loop = loop
            loop.add_reader(self.proc.fileno(), self._on_reply)
        if self._dead is not None:
            future.set_exception(self._dead)
            return future
        message = ("step", *self._message(plan))
        self._blocks, self._sampling, self._gone = {}, {}, []
        try:
            self.proc.send(message)
        except EngineProcessError as exc:
            self._died(exc)
            future.set_exception(exc)
            return future
        self._pending = future
        return future

    def _message(self, plan: StepPlan) -> tuple[Any, ...]:
        items = step_items(plan)
        places: list[list[tuple[int, int, int]]] = []  #: per item (offset, staging row, rows)
        at = 0
        for i, item in enumerate(items):
            where = []
            for offset, r in item.embeds:
                self._staging[at : at + r.shape[0]].copy_(r)
                where.append((offset, at, r.shape[0]))
                at += r.shape[0]
            places.append(where)
            if item.embeds:
                items[i] = item._replace(embeds=[])
        return items, places, self._blocks, self._sampling, self._gone

    def _on_reply(self) -> None:
        """The pipe is readable: a step's reply, or EOF (the engine process is gone)."""
        future, self._pending = self._pending, None
        try:
            reply = self.proc.recv()
        except EngineProcessError as exc:
            self._died(exc)
            if future is not None and not future.done():
                future.set_exception(exc)
            return
        if future is None or future.done():  # pragma: no cover - the step loop was cancelled
            return
        if reply[0] == "err":
            future.set_exception(EngineError(reply[1]))
        else:
            future.set_result(reply[1])

    def _died(self, exc: EngineProcessError) -> None:
        self._dead = exc
        self.close()

    def close(self) -> None:
        """Stop listening to the engine process (before it is closed)."""
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self.proc.fileno())


# ---- the engine process ------------------------------------------------------------------------
def main(ctl_fd: int, fds_fd: int) -> None:  # pragma: no cover - runs in the engine process
    """The engine process: load, answer ``ModelInfo``, then run steps until ``ctl`` closes
    (its tests drive it end to end)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    conn = Connection(ctl_fd)
    fds = socket.socket(fileno=fds_fd)
    try:
        load = conn.recv()
    except EOFError:
        return
    _, model_dir, device, dtype, threads = load
    torch.set_num_threads(threads)
    from omniflow.compute._loader import load_model

    try:
        model = load_model(model_dir, device=device, dtype=dtype)
    except Exception as exc:
        conn.send(("error", type(exc).__name__, str(exc), getattr(exc, "path", None)))
        return
    conn.send(("loaded", model.cfg, str(model.device), str(model.dtype).removeprefix("torch.")))
    arrays = _receive(fds, "stores")
    if arrays is None:
        return
    runner = ModelRunner(model, L1Pages(list(zip(arrays[::2], arrays[1::2], strict=True))))
    staging = _receive(fds, "staging")
    while staging is not None:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            break
        try:
            conn.send(_step(runner, staging[0], *message[1:]))
        except OSError:  # the engine stopped while this step ran: nobody reads the reply
            break
    # Nothing of ours to flush or clean (the shared arrays are the parent's): skip the
    # interpreter's teardown of torch, which costs ~0.5 s the engine's stop would wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _receive(fds: socket.socket, name: str) -> list[torch.Tensor] | None:
    """The arrays ``EngineProcess.share`` sent as ``name`` (None: the parent closed)."""
    data, fd_list, _, _ = socket.recv_fds(fds, 1 << 20, 1024)
    if not data:
        return None
    got, handles = pickle.loads(data)
    assert got == name, (got, name)
    arrays = []
    for fd, (size, dtype, offset, shape, stride) in zip(fd_list, handles, strict=True):
        storage = torch.UntypedStorage._new_shared_fd_cpu(fd, size)  # type: ignore[attr-defined]
        os.close(fd)
        arrays.append(
            torch.empty(0, dtype=getattr(torch, dtype)).set_(storage, offset, shape, stride)
        )
    return arrays


def _step(
    runner: ModelRunner,
    staging: torch.Tensor,
    items: list[StepItem],
    places: list[list[tuple[int, int, int]]],
    blocks: dict[str, list[int]],
    sampling: dict[str, SamplingParams],
    gone: list[str],
) -> tuple[str, Any]:
    """Apply what changed since the last step, then run this one: ("ok", tokens) or
    ("err", message)."""
    try:
        for request_id in gone:  # first: a finished request's id may be reused by a new one
            runner.detach(request_id)
        for request_id, params in sampling.items():
            runner.sample_with(request_id, params)
        for request_id, ids in blocks.items():
            old = runner.attached(request_id)
            if old is None or ids[: len(old)] != old:
                runner.detach_pages(request_id)  # preempted and placed anew
            runner.attach_slots(request_id, ids)
        rows = [
            item._replace(embeds=[(off, staging[at : at + n]) for off, at, n in where])
            if where
            else item
            for item, where in zip(items, places, strict=True)
        ]
        return ("ok", runner.run(rows))
    except Exception as exc:
        return ("err", f"forward pass failed in the engine process: {exc!r}")


#: The engine process's program: ``main`` with the two descriptors ``start`` passed.
_ENTRY = f"import sys; from {__name__} import main; main(int(sys.argv[1]), int(sys.argv[2]))"
