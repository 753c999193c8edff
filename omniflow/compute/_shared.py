"""``of.shared_module``: one physical copy of a module's weights per node, whoever asks.

>>> # module = await of.shared_module("llm/qwen2-7b", lambda: Net(cfg), "ckpt/qwen2-7b")

``build()`` runs with torch's factory functions sent to the meta device (the
``torch.device("meta")`` function mode, active only for the duration of the call), so building
allocates nothing. Every parameter and buffer is then bound, by its structured name, to a tensor
in the key's shared segment (see ``_shm``). The first process to find the segment not ready takes
the load lock and copies the safetensors of ``weights_dir`` into it (the owner, mapping it
read-write); the others poll (asyncio sleeps with backoff, no thread is blocked) until the header
says ready, then map it read-only (followers). A follower's parameters are ``SkipCopyParameter``s
and its buffers ``SkipCopyBuffer``s whose ``copy_`` is a no-op, so ``load_state_dict`` (and any
``copy_``) leaves the owner's weights alone; a write that bypasses them hits a read-only mapping.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from omniflow.compute import _shm
from omniflow.compute._errors import EngineError, ModelLoadError
from omniflow.compute._files import shard_files

__all__ = ["SkipCopyBuffer", "SkipCopyParameter", "shared_module"]

#: key -> (users fd, segment): a process is a user of a key until it exits.
_ATTACHED: dict[str, tuple[int, _shm.Segment]] = {}


class SkipCopyParameter(torch.nn.Parameter):
    """A follower's view of a shared weight: ``copy_`` into it does nothing."""

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        return self


class SkipCopyBuffer(torch.Tensor):
    """A follower's view of a shared buffer: ``copy_`` into it does nothing."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        return self


def _tensors(module: torch.nn.Module) -> dict[str, tuple[str, torch.Tensor, bool]]:
    """Structured name -> (canonical name, tensor, is_parameter); aliases (tied weights) map to
    the first name the tensor was registered under."""
    seen: dict[int, str] = {}
    out: dict[str, tuple[str, torch.Tensor, bool]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        canon = seen.setdefault(id(p), name)
        out[name] = (canon, p, True)
    for name, b in module.named_buffers(remove_duplicate=False):
        canon = seen.setdefault(id(b), name)
        out[name] = (canon, b, False)
    return out


def _layout(tensors: dict[str, tuple[str, torch.Tensor, bool]]) -> tuple[bytes, int]:
    entries: list[tuple[str, str, list[int], int, int]] = []
    pos = 0
    for name, (canon, t, _) in tensors.items():
        if canon != name:
            continue
        nbytes = t.numel() * t.element_size()
        entries.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), pos, nbytes))
        pos += (nbytes + _shm.ALIGN - 1) // _shm.ALIGN * _shm.ALIGN
    return _shm.manifest_bytes(entries), pos


def _views(seg: _shm.Segment) -> dict[str, torch.Tensor]:
    import json

    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():  # a follower's mapping is read-only on purpose
        warnings.simplefilter("ignore", UserWarning)
        for name, dtype, shape, off, nbytes in json.loads(seg.manifest):
            dt = getattr(torch, dtype)
            count = nbytes // torch.empty((), dtype=dt).element_size()
            flat = torch.frombuffer(seg.buf, dtype=dt, count=count, offset=seg.offset + off)
            out[name] = flat.view(shape)
    return out


def _fill(
    seg: _shm.Segment,
    views: dict[str, torch.Tensor],
    key: str,
    weights_dir: Path,
    build: Callable[[], torch.nn.Module],
) -> None:
    """Owner: copy every checkpoint tensor into the segment, one at a time."""
    from safetensors import safe_open

    wanted = set(views)
    for path in shard_files(weights_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if name in views:
                        src = f.get_tensor(name)
                        dst = views[name]
                        if tuple(src.shape) != tuple(dst.shape):
                            raise ModelLoadError(
                                f"shared_module {key!r}: {path.name} holds {name!r} with shape "
                                f"{tuple(src.shape)} but the module built has {tuple(dst.shape)}",
                                path=str(path),
                            )
                        dst.copy_(src)
                        wanted.discard(name)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}", path=str(path)) from exc
    _trim_heap()  # the transient tensors read from the files go back to the OS now
    if not wanted:
        return
    # Buffers computed in __init__ (e.g. rotary frequencies) are not in checkpoints: rebuild the
    # module once for real to get them (a transient private copy in the owner only).
    real = {n: t for n, t in _tensors(build()).items()}
    missing = []
    for name in sorted(wanted):
        entry = real.get(name)
        if entry is None or entry[2]:  # parameters must come from the checkpoint
            missing.append(name)
        else:
            views[name].copy_(entry[1].detach())
    if missing:
        raise ModelLoadError(
            f"shared_module {key!r}: {weights_dir} has no tensor for {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}; the checkpoint does not match what build() "
            "returns",
            path=str(weights_dir),
        )


def _trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``; elsewhere nothing): the
    owner's copy loop frees each checkpoint tensor it read, and without this glibc keeps those
    pages, a private near-copy of the weights that sharing exists to avoid."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:  # pragma: no cover - not glibc
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - a libc without malloc_trim
        return


def _bind(
    module: torch.nn.Module,
    tensors: dict[str, tuple[str, torch.Tensor, bool]],
    views: dict[str, torch.Tensor],
    follower: bool,
) -> None:
    made: dict[str, torch.Tensor] = {}
    for name, (canon, _, is_param) in tensors.items():
        shared = made.get(canon)
        if shared is None:
            view = views[canon]
            if is_param:
                cls = SkipCopyParameter if follower else torch.nn.Parameter
                shared = cls(view, requires_grad=False)
            else:
                shared = view.as_subclass(SkipCopyBuffer) if follower else view
            made[canon] = shared
        owner_name, _, attr = name.rpartition(".")
        sub = module.get_submodule(owner_name)
        if is_param:
            sub._parameters[attr] = shared  # type: ignore[assignment]
        else:
            sub._buffers[attr] = shared


def _build_meta(build: Callable[[], torch.nn.Module], key: str) -> torch.nn.Module:
    with torch.device("meta"):
        module = build()
    if not isinstance(module, torch.nn.Module):
        raise EngineError(
            f"shared_module {key!r}: build() returned {type(module).__name__}, not a "
            "torch.nn.Module; pass a callable that constructs the model"
        )
    return module


def _check_device(device: str | torch.device, key: str) -> None:
    if torch.device(device).type != "cpu":
        raise NotImplementedError(
            f"shared_module {key!r}: device {str(device)!r} needs CUDA IPC handles "
            "(torch.multiprocessing reductions over cudaIpcMemHandle), which this build does not "
            "implement: it was written without a GPU to test it on. Use device='cpu' (host shared "
            "memory) or load the model privately per process."
        )


async def shared_module(
    key: str,
    build: Callable[[], torch.nn.Module],
    weights_dir: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    timeout: float = 600.0,
) -> torch.nn.Module:
    """Build ``build()`` on the meta device and bind its weights to the node's shared copy for
    ``key`` (loading it from ``weights_dir`` if this process is the first). See module docs."""
    if not key or not isinstance(key, str):
        raise EngineError(f"shared_module: key must be a non-empty string, got {key!r}")
    _check_device(device, key)
    root = Path(weights_dir)
    module = _build_meta(build, key)
    tensors = _tensors(module)
    manifest, nbytes = _layout(tensors)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = 0.002
    attached = _ATTACHED.get(key)
    while attached is None:
        attached = await _attach_once(key, manifest, nbytes, root, build)
        if attached is not None:
            _ATTACHED[key] = attached
            break
        if loop.time() >= deadline:
            raise EngineError(
                f"shared_module {key!r}: weights not ready after {timeout:.0f}s; the owner is "
                f"still loading {root} (raise timeout=) or is stuck"
            )
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.25)
    _, seg = attached
    if seg.manifest != manifest:
        raise EngineError(
            f"shared_module {key!r}: another process built a different module under this key "
            "(parameter names, shapes or dtypes differ); use one key per architecture and "
            "checkpoint"
        )
    _bind(module, tensors, _views(seg), follower=not seg.writable)
    return module


async def _attach_once(
    key: str, manifest: bytes, nbytes: int, root: Path, build: Callable[[], torch.nn.Module]
) -> tuple[int, _shm.Segment] | None:
    joined = _shm.join_users(key)
    if joined is None:
        return None
    names, ufd = joined
    try:
        seg = _shm.Segment.open_ready(names.data)
        if seg is not None:
            return ufd, seg
        lfd = os.open(names.load, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if not _shm._try_flock(lfd, fcntl.LOCK_EX):
                os.close(ufd)
                return None  # someone is loading: poll again
            seg = _shm.Segment.open_ready(names.data)  # loaded while we took the lock
            if seg is not None:
                return ufd, seg
            seg = _shm.Segment.create(names.data, manifest, nbytes)
            await asyncio.to_thread(_fill, seg, _views(seg), key, root, build)
            seg.mark_ready()
            return ufd, seg
        finally:
            os.close(lfd)  # drops the load lock
    except BaseException:
        os.close(ufd)
        raise


#: (shard path, size, mtime_ns) -> sha256 of its bytes (a process hashes a file once).
_DIGESTS: dict[tuple[str, int, int], str] = {}


def checkpoint_key(weights_dir: str | os.PathLike[str], dtype: torch.dtype) -> str:
    """The checkpoint's content identity and ``dtype``: equal for two copies of the same files
    wherever they lie, so replicas and co-located roles over one checkpoint share one copy."""
    import hashlib

    h = hashlib.sha256(str(dtype).encode())
    for path in shard_files(Path(weights_dir)):
        st = path.stat()
        memo = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        digest = _DIGESTS.get(memo)
        if digest is None:
            fh = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    fh.update(block)
            digest = _DIGESTS[memo] = fh.hexdigest()
        h.update(path.name.encode() + b"\0" + digest.encode())
    return "ckpt/" + h.hexdigest()[:32]


def _checkpoint_tree(shapes: dict[str, list[int]], dtype: torch.dtype) -> torch.nn.Module:
    """A module whose parameters are the checkpoint's tensors under their own dotted names."""
    root = torch.nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            child = mod._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                mod.add_module(part, child)
            mod = child
        empty = torch.empty(shape, dtype=dtype)
        mod.register_parameter(leaf, torch.nn.Parameter(empty, requires_grad=False))
    return root


def load_shared_weights(weights_dir: str | os.PathLike[str], dtype: torch.dtype) -> dict[str, Any]:
    """Every tensor of the checkpoint in ``dtype`` on the CPU, bound to the node's one shared
    copy (``shared_module`` keyed by ``checkpoint_key``): the first process to ask loads it,
    the others map it. Synchronous (an engine calls it on its loading thread)."""
    from safetensors import SafetensorError, safe_open

    root = Path(weights_dir)
    shapes: dict[str, list[int]] = {}
    for path in shard_files(root):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    shapes[name] = list(f.get_slice(name).get_shape())
        except (OSError, ValueError, SafetensorError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}", path=str(path)) from exc
    key = checkpoint_key(root, dtype)
    module = asyncio.run(shared_module(key, lambda: _checkpoint_tree(shapes, dtype), root))
    return {name: p.detach() for name, p in module.named_parameters()}
