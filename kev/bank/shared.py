"""The bank's memory in a form other processes map: shared memory on CPU, CUDA IPC on GPU.

Owner (bank_service): `SharedBank.create(...)` carves every pool, the block table and the slot
generations out of shared segments, hands them to a `kev.bank.bank.Bank` (the allocator), and
describes them as `kev.v1.AttachResponse` TensorDescriptors (`attach_response`).
Mapper (a colocated scorer): `attach(response)` maps the same memory and returns an
`AttachedBank`, which `kev.exec.passes.Passes` takes in place of a `Bank` (pools, block_table, check).
No state is ever copied: both processes read and write the same bytes.

Segments
    CPU:  one file under `shm_dir` (/dev/shm) holding every tensor, each 256-byte aligned.
    CUDA: one device buffer (pools + block table) shared by CUDA IPC, plus a small /dev/shm file
          for the slot generations, so a handle check is a host read and never a GPU sync.

Tensors (TensorDescriptor.name)
    layers.{i}.recurrent     [slots, HV, K, V] fp32           DeltaNet layer i (kev.bank.layout)
    layers.{i}.conv          [slots, conv_dim, W-1] model dtype
    layers.{i}.key_blocks    [blocks, block_size, Hkv, D]     attention layer i, paged
    layers.{i}.value_blocks  [blocks, block_size, Hkv, D]
    block_table              [slots, max_blocks] int32        K/V pages of each slot, -1 unused
    generations              [slots] int64, CPU               live generation of each slot
    fingerprints             [slots] int64, CPU               key fingerprint of each slot's document (0: none)

Descriptor bytes (TensorDescriptor.descriptor) are JSON naming the segment:
    SHARED_MEMORY  {"path": "/dev/shm/kev-bank-<instance>", "bytes": <segment size>}
    CUDA_IPC       {"ipc": {<torch reduce_tensor fields of the segment's uint8 buffer; bytes base64>}}
`storage_offset` counts elements of the tensor's dtype from the segment start, and shape/stride
are in elements, so the mapper rebuilds the exact (possibly strided) view with `as_strided`.

Generations: the owner seeds every slot with `generation_seed()` (seconds since 2025 << 32), so a
restarted bank never reissues a (slot, generation) of an earlier run; each free bumps the slot's
generation in the shared table before its pages change. `AttachedBank.check` reads that table.

Lifetime: the owner must outlive every mapper (CUDA IPC requires it). On CPU the owner unlinks the
file at `close()`; mappings that exist stay valid until dropped. A restarted bank has a new
instance id and new segment names, so mappers must re-attach (AttachResponse.instance changed).

Crashes leave nothing behind (issue 27). The owner holds an exclusive `flock` on each of its files
for its whole life, and starts a tiny reaper process (`python -S`, no imports) holding the other
end of a pipe: when the owner dies, even by SIGKILL, the pipe closes and the reaper unlinks the
files (mappings that exist stay valid). If the reaper died too (a container killed whole), the
next bank reclaims at start-up every `kev-bank-*` file in its shm dir whose lock is free and
whose owner pid is not a live process here (`reclaim_stale_segments`); a live bank's file is
locked and never touched.
"""

from __future__ import annotations

import base64
import fcntl
import json
import logging
import mmap
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kev.bank.bank import Bank, BankHandle, StaleHandle
from kev.bank.layout import StatePools
from kev.model.config import ModelConfig
from kev.v1 import bank_pb2 as pb

log = logging.getLogger(__name__)

LAYOUT_VERSION = 2  # 2: fingerprints beside the generations
SEGMENT_PREFIX = "kev-bank-"
# kev-bank-<time>-<pid>-<uuid> (bank_service), and its weights (kev/bank/shared_weights.py)
_SEGMENT_NAME = re.compile(r"kev-bank-[0-9a-f]+-(\d+)-[0-9a-f]+(?:-weights)?")
# The reaper: waits for its stdin (a pipe the owner holds) to close, then unlinks its arguments.
_REAPER = ("import os,sys\nsys.stdin.buffer.read()\nfor p in sys.argv[1:]:\n"
           " try: os.unlink(p)\n except OSError: pass\n")
ALIGN_BYTES = 256
GENERATION_EPOCH_S = 1_735_689_600  # 2025-01-01T00:00:00Z: generation seeds count seconds from here

_TO_PROTO = {
    torch.float32: pb.FLOAT32,
    torch.bfloat16: pb.BFLOAT16,
    torch.float16: pb.FLOAT16,
    torch.int32: pb.INT32,
    torch.int64: pb.INT64,
}
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(recurrent|conv|key_blocks|value_blocks)")


def generation_seed(now_s: float | None = None) -> int:
    """First generation of every slot for a bank starting now: whole seconds since 2025 in the
    high 32 bits, so a restart (more than a second later) starts above every generation issued
    before (each slot has 2^32 frees per run before it could reach the next second's range)."""
    seconds = int(time.time() if now_s is None else now_s) - GENERATION_EPOCH_S
    if not 0 <= seconds < 1 << 31:
        raise ValueError(f"clock out of range for generation seeds: {seconds} s since 2025")
    return seconds << 32


@dataclass(frozen=True)
class _Spec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_host: bool  # generations: always host shared memory, even for a CUDA bank


def _specs(cfg: ModelConfig, num_slots: int, num_blocks: int, block_size: int, max_blocks: int,
           dtype: torch.dtype) -> list[_Spec]:
    s = StatePools.shapes(cfg, num_slots, num_blocks, block_size)
    specs: list[_Spec] = []
    for i in cfg.deltanet_layers:
        specs += [_Spec(f"layers.{i}.recurrent", s["recurrent"], torch.float32, False),
                  _Spec(f"layers.{i}.conv", s["conv"], dtype, False)]
    for i in cfg.attention_layers:
        specs += [_Spec(f"layers.{i}.key_blocks", s["kv"], dtype, False),
                  _Spec(f"layers.{i}.value_blocks", s["kv"], dtype, False)]
    specs += [_Spec("block_table", (num_slots, max_blocks), torch.int32, False),
              _Spec("generations", (num_slots,), torch.int64, True),
              _Spec("fingerprints", (num_slots,), torch.int64, True)]
    return specs


def _nbytes(spec: _Spec) -> int:
    n = 1
    for d in spec.shape:
        n *= d
    return n * torch.empty((), dtype=spec.dtype).element_size()


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def _typed_view(base: torch.Tensor, dtype: torch.dtype, shape, stride, storage_offset: int) -> torch.Tensor:
    """The tensor at element `storage_offset` (in `dtype` units) of a uint8 segment, in place."""
    esize = torch.empty((), dtype=dtype).element_size()
    if base.numel() % esize:
        raise ValueError(f"segment of {base.numel()} bytes is not a multiple of {dtype}'s {esize} bytes")
    return base.view(dtype).as_strided(tuple(shape), tuple(stride), storage_offset)


# ---------------------------------------------------------------------------------------------
# Segments: a /dev/shm file or a CUDA allocation, seen as one flat uint8 tensor.


class _Segment:
    sharing: int
    base: torch.Tensor  # [bytes] uint8

    def descriptor(self) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        self.base = torch.empty(0, dtype=torch.uint8)


class _ShmSegment(_Segment):
    sharing = pb.SHARED_MEMORY

    def __init__(self, path: Path, nbytes: int, *, create: bool):
        self.path, self.nbytes, self.owner = path, nbytes, create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        self._lock_fd: int | None = None
        try:
            if create:
                # Held for the owner's life: a free lock marks a dead owner's file (reclaim_stale_segments).
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock_fd = os.dup(fd)
                try:
                    # Reserve the pages now: a full tmpfs fails here, not as SIGBUS on first write.
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError:
                    os.unlink(path)
                    raise
            elif os.fstat(fd).st_size != nbytes:
                raise ValueError(f"{path}: {os.fstat(fd).st_size} bytes, the descriptor says {nbytes}")
            mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            raise
        finally:
            os.close(fd)
        # frombuffer keeps `mapping` alive as long as any view of it lives.
        self.base = torch.frombuffer(mapping, dtype=torch.uint8)

    def descriptor(self) -> bytes:
        return json.dumps({"path": str(self.path), "bytes": self.nbytes}).encode()

    def close(self) -> None:
        super().close()
        if self.owner:
            self.path.unlink(missing_ok=True)
            self.owner = False
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reclaim_stale_segments(shm_dir: str | Path) -> list[Path]:
    """Unlinks `kev-bank-*` files in `shm_dir` left by banks that died (module docstring): the file's
    lock is free and the pid in its name is not a live process here (or is this process: a container
    restarted with the same pid). Returns the files removed."""
    removed = []
    for path in sorted(Path(shm_dir).glob(SEGMENT_PREFIX + "*")):
        m = _SEGMENT_NAME.fullmatch(path.name)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid != os.getpid() and _pid_alive(pid):
            continue
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # locked: its owner lives
        else:
            path.unlink(missing_ok=True)
            removed.append(path)
        finally:
            os.close(fd)
    if removed:
        log.warning("reclaimed %d shared-memory segment(s) of dead bank instances: %s", len(removed),
                    ", ".join(p.name for p in removed))
    return removed


class _Reaper:
    """A `python -S` child that unlinks `paths` once this process is gone (its stdin pipe closes)."""

    def __init__(self, paths: list[Path]):
        self.proc = subprocess.Popen([sys.executable, "-S", "-c", _REAPER, *map(str, paths)],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, close_fds=True)

    def close(self) -> None:
        """After the owner unlinked its files itself: the reaper exits."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _b64(x: bytes | None) -> str | None:
    return None if x is None else base64.b64encode(x).decode()


def _unb64(x: str | None) -> bytes | None:
    return None if x is None else base64.b64decode(x)


class _CudaSegment(_Segment):
    sharing = pb.CUDA_IPC

    def __init__(self, base: torch.Tensor):
        self.base = base

    @classmethod
    def allocate(cls, nbytes: int, device: torch.device) -> "_CudaSegment":
        return cls(torch.zeros(nbytes, dtype=torch.uint8, device=device))

    def descriptor(self) -> bytes:
        # A fresh reduce per Attach: each mapper gets its own IPC ref-counter entry.
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(self.base)
        (_cls, size, stride, offset, _scls, _dtype, device, handle, storage_bytes, storage_offset_bytes,
         _grad, ref_handle, ref_offset, event_handle, event_sync) = args
        ipc = {"size": list(size), "stride": list(stride), "offset": offset, "device": device,
               "handle": _b64(handle), "storage_bytes": storage_bytes,
               "storage_offset_bytes": storage_offset_bytes, "ref_counter_handle": _b64(ref_handle),
               "ref_counter_offset": ref_offset, "event_handle": _b64(event_handle),
               "event_sync_required": event_sync}
        return json.dumps({"ipc": ipc}).encode()

    @classmethod
    def open(cls, ipc: dict) -> "_CudaSegment":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        base = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(ipc["size"]), tuple(ipc["stride"]), ipc["offset"],
            torch.storage.TypedStorage, torch.uint8, ipc["device"], _unb64(ipc["handle"]),
            ipc["storage_bytes"], ipc["storage_offset_bytes"], False, _unb64(ipc["ref_counter_handle"]),
            ipc["ref_counter_offset"], _unb64(ipc["event_handle"]), ipc["event_sync_required"],
        )
        return cls(base)


# ---------------------------------------------------------------------------------------------
# Owner


class SharedBank:
    """The owner's side: a `Bank` whose pools, block table and generations live in shared segments."""

    def __init__(self, bank: Bank, tensors: dict[str, torch.Tensor], placement: dict[str, _Segment],
                 segments: list[_Segment], instance: str):
        self.bank = bank
        self.tensors = tensors
        self._placement = placement
        self._segments = segments
        self.instance = instance
        paths = self.segment_paths
        self._reaper = _Reaper(paths) if paths else None

    @classmethod
    def create(cls, cfg: ModelConfig, memory_bytes: int, *, instance: str, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", block_size: int = 64, avg_doc_tokens: int = 1024,
               max_doc_tokens: int = 65536, seed: int | None = None, shm_dir: str | Path = "/dev/shm") -> "SharedBank":
        """Split `memory_bytes` as `Bank.from_budget` does, in shared memory; every slot starts at
        generation `seed` (default `generation_seed()`). `instance` names the segment files."""
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", instance):
            raise ValueError(f"instance must be a plain file-name word, got {instance!r}")
        device = torch.device(device)
        num_slots, num_blocks = Bank.budget_split(cfg, memory_bytes, avg_doc_tokens=avg_doc_tokens,
                                                  block_size=block_size, dtype=dtype, max_doc_tokens=max_doc_tokens)
        max_blocks = -(-max_doc_tokens // block_size)
        specs = _specs(cfg, num_slots, num_blocks, block_size, max_blocks, dtype)
        # Generations always in host memory; on CPU everything shares that one file.
        host = [s for s in specs if s.on_host or device.type != "cuda"]
        on_device = [s for s in specs if s not in host]
        segments: list[_Segment] = []
        tensors: dict[str, torch.Tensor] = {}
        placement: dict[str, _Segment] = {}
        try:
            for group in (host, on_device):
                if not group:
                    continue
                offsets = [0]
                for spec in group:
                    offsets.append(offsets[-1] + _align(_nbytes(spec)))
                if group is host:
                    segment: _Segment = _ShmSegment(Path(shm_dir) / f"kev-bank-{instance}", offsets[-1], create=True)
                else:
                    segment = _CudaSegment.allocate(offsets[-1], device)
                segments.append(segment)
                for spec, offset in zip(group, offsets):
                    esize = torch.empty((), dtype=spec.dtype).element_size()
                    contiguous = torch.empty(spec.shape, dtype=spec.dtype, device="meta").stride()
                    tensors[spec.name] = _typed_view(segment.base, spec.dtype, spec.shape, contiguous, offset // esize)
                    placement[spec.name] = segment
            generations = tensors["generations"]
            generations.fill_(generation_seed() if seed is None else seed)
            pools = StatePools(
                recurrent=tuple(tensors[f"layers.{i}.recurrent"] for i in cfg.deltanet_layers),
                conv=tuple(tensors[f"layers.{i}.conv"] for i in cfg.deltanet_layers),
                keys=tuple(tensors[f"layers.{i}.key_blocks"] for i in cfg.attention_layers),
                values=tuple(tensors[f"layers.{i}.value_blocks"] for i in cfg.attention_layers),
                block_size=block_size,
            )
            bank = Bank(cfg, pools, max_doc_tokens, block_table=tensors["block_table"], generations=generations,
                        fingerprints=tensors["fingerprints"])
        except BaseException:
            for segment in segments:
                segment.close()
            raise
        return cls(bank, tensors, placement, segments, instance)

    @property
    def segment_paths(self) -> list[Path]:
        """The /dev/shm files this bank owns (removed by `close`)."""
        return [s.path for s in self._segments if isinstance(s, _ShmSegment)]

    def descriptors(self) -> list[pb.TensorDescriptor]:
        """Every shared tensor as a TensorDescriptor (CUDA IPC handles are fresh per call)."""
        seg_bytes = {id(s): s.descriptor() for s in self._segments}
        return [describe(name, t, self._placement[name], seg_bytes[id(self._placement[name])])
                for name, t in self.tensors.items()]

    def attach_response(self, model: str, node: str,
                        weights: list[pb.TensorDescriptor] | None = None) -> pb.AttachResponse:
        """What a mapper needs; `weights`: the model's shared weights (kev/bank/shared_weights.py), if any."""
        pools = self.bank.pools
        return pb.AttachResponse(
            model=model, node=node, instance=self.instance, slot_count=pools.num_slots,
            block_size=pools.block_size, block_count=pools.num_blocks, pools=self.descriptors(),
            weights_shared=bool(weights), weights=weights or [], layout_version=LAYOUT_VERSION)

    def close(self) -> None:
        """Unlink the segment files and drop this process's views. Call after every mapper is gone
        (on CUDA the memory is freed with the last reference)."""
        for segment in self._segments:
            segment.close()
        self.tensors = {}
        self._placement = {}
        if self._reaper is not None:
            self._reaper.close()
            self._reaper = None


# ---------------------------------------------------------------------------------------------
# Mapper


class WrongDocument(StaleHandle):
    """The handle is live but its slot holds another document: the directory entry was wrong."""


@dataclass(eq=False)
class AttachedBank:
    """A mapped view of another process's bank: what `kev.exec.passes.Passes` needs of a bank.

    `pools` and `block_table` are the owner's memory (writes land in place); `generations` is the
    owner's live generation per slot. Never allocates or frees: that is the owner's job.
    """

    model: str
    node: str
    instance: str
    pools: StatePools
    block_table: torch.Tensor  # [slots, max_blocks] int32, on the bank's device
    generations: torch.Tensor  # [slots] int64, CPU shared memory
    tensors: dict[str, torch.Tensor] = field(repr=False)
    fingerprints: torch.Tensor | None = None  # [slots] int64, CPU shared memory: each slot's document
    files: list[Path] = field(default_factory=list)  # the owner's /dev/shm files (the generations' at least)

    def __post_init__(self) -> None:
        self._host_views()

    def _host_views(self) -> None:
        """NumPy views of the host tables: the scorer checks every handle of a pass before it
        launches, and a NumPy read keeps the GIL where a torch index would give it up twice."""
        self._generations = self.generations.numpy()
        self._fingerprints = None if self.fingerprints is None else self.fingerprints.numpy()

    @property
    def num_slots(self) -> int:
        return self.generations.shape[0]

    @property
    def block_size(self) -> int:
        return self.pools.block_size

    def is_live(self, handle: BankHandle) -> bool:
        return 0 <= handle.slot < self.num_slots and int(self._generations[handle.slot]) == handle.generation

    def owner_alive(self) -> bool:
        """Whether the owner still holds its memory: it unlinks its files when it stops, and its
        reaper when it dies (even by SIGKILL). A host read; no RPC, no GPU."""
        return all(p.exists() for p in self.files)

    def check(self, handle: BankHandle, fingerprint: int | None = None) -> None:
        """Raises StaleHandle unless `handle` is the slot's live generation in the owner's table, and
        WrongDocument unless the slot holds the document of `fingerprint` (when given)."""
        if not self.is_live(handle):
            raise StaleHandle(f"bank handle {handle} is not live in bank instance {self.instance}")
        if fingerprint is not None and self._fingerprints is not None:
            held = int(self._fingerprints[handle.slot])
            if held != fingerprint:
                raise WrongDocument(f"bank slot {handle.slot} (generation {handle.generation}) holds another "
                                    f"document (key fingerprint {held:#x}, expected {fingerprint:#x})")

    def close(self) -> None:
        """Drop this process's mappings (they go when the last view of them is gone)."""
        empty = torch.empty(0)
        self.pools = StatePools((), (), (), (), self.pools.block_size)
        self.block_table = self.generations = self.fingerprints = empty
        self.tensors = {}
        self._host_views()


def _open_segment(sharing: int, descriptor: bytes) -> _Segment:
    raw = json.loads(descriptor)
    if sharing == pb.SHARED_MEMORY:
        return _ShmSegment(Path(raw["path"]), int(raw["bytes"]), create=False)
    if sharing == pb.CUDA_IPC:
        return _CudaSegment.open(raw["ipc"])
    raise ValueError(f"unknown sharing {sharing}")


def describe(name: str, t: torch.Tensor, segment: _Segment, segment_bytes: bytes) -> pb.TensorDescriptor:
    """`t`, a view of `segment` (whose `descriptor()` is `segment_bytes`), as a TensorDescriptor."""
    return pb.TensorDescriptor(name=name, shape=list(t.shape), stride=list(t.stride()),
                               storage_offset=t.storage_offset(), dtype=_TO_PROTO[t.dtype], device=str(t.device),
                               sharing=segment.sharing, descriptor=segment_bytes)


def map_descriptors(descriptors, what: str = "tensor") -> tuple[dict[str, torch.Tensor], list[Path]]:
    """name -> the view each descriptor names, each segment opened once; and the /dev/shm files
    opened. Raises ValueError on an unknown dtype or a view past its segment, OSError when a
    segment cannot be opened."""
    segments: dict[tuple[int, bytes], _Segment] = {}
    tensors: dict[str, torch.Tensor] = {}
    for d in descriptors:
        if d.dtype not in _FROM_PROTO:
            raise ValueError(f"{what} {d.name!r}: unknown dtype {d.dtype}")
        key = (d.sharing, d.descriptor)
        if key not in segments:
            segments[key] = _open_segment(d.sharing, d.descriptor)
        try:
            tensors[d.name] = _typed_view(segments[key].base, _FROM_PROTO[d.dtype], d.shape, d.stride,
                                          d.storage_offset)
        except RuntimeError as e:  # as_strided past the segment's end
            raise ValueError(f"{what} {d.name!r} does not fit its segment: {e}") from None
    return tensors, [s.path for s in segments.values() if isinstance(s, _ShmSegment)]


def attach(response: pb.AttachResponse) -> AttachedBank:
    """Map the bank an `Attach` call described. Raises ValueError on a layout this code does not
    know, a missing tensor or inconsistent shapes; OSError when a segment cannot be opened."""
    if response.layout_version != LAYOUT_VERSION:
        raise ValueError(f"bank layout version {response.layout_version}, this code reads {LAYOUT_VERSION}")
    tensors, files = map_descriptors(response.pools)
    layers: dict[str, dict[int, torch.Tensor]] = {k: {} for k in ("recurrent", "conv", "key_blocks", "value_blocks")}
    for name, t in tensors.items():
        if m := _LAYER_NAME.fullmatch(name):
            layers[m.group(2)][int(m.group(1))] = t
    for name in ("block_table", "generations", "fingerprints"):
        if name not in tensors:
            raise ValueError(f"attach response lacks tensor {name!r}")
    if sorted(layers["recurrent"]) != sorted(layers["conv"]) \
            or sorted(layers["key_blocks"]) != sorted(layers["value_blocks"]):
        raise ValueError("attach response: each DeltaNet layer needs recurrent+conv, each attention layer keys+values")
    pools = StatePools(
        recurrent=tuple(layers["recurrent"][i] for i in sorted(layers["recurrent"])),
        conv=tuple(layers["conv"][i] for i in sorted(layers["conv"])),
        keys=tuple(layers["key_blocks"][i] for i in sorted(layers["key_blocks"])),
        values=tuple(layers["value_blocks"][i] for i in sorted(layers["value_blocks"])),
        block_size=response.block_size,
    )
    generations, block_table = tensors["generations"], tensors["block_table"]
    if generations.device.type != "cpu" or generations.dtype != torch.int64:
        raise ValueError("attach response: generations must be int64 in host shared memory")
    slots = response.slot_count
    if generations.shape != (slots,) or block_table.shape[0] != slots or any(
            t.shape[0] != slots for t in (*pools.recurrent, *pools.conv)):
        raise ValueError(f"attach response: tensors disagree with slot_count {slots}")
    if any(t.shape[:2] != (response.block_count, response.block_size) for t in (*pools.keys, *pools.values)):
        raise ValueError(f"attach response: K/V pools disagree with {response.block_count} blocks "
                         f"of {response.block_size}")
    fingerprints = tensors["fingerprints"]
    if fingerprints.device.type != "cpu" or fingerprints.dtype != torch.int64 or fingerprints.shape != (slots,):
        raise ValueError("attach response: fingerprints must be [slots] int64 in host shared memory")
    return AttachedBank(response.model, response.node, response.instance, pools, block_table, generations, tensors,
                        fingerprints, files)
