"""Delta weight sync (--weight-sync-mode delta; slime's --update-weight-mode delta): the trainer
publishes only the bytes that changed since the last sync to a shared folder, each engine host
applies them in place to a full HF checkpoint of its own, and the engines reload that through
SGLang's stock /update_weights_from_disk. For engines far from the trainer (another cluster,
another datacenter), where writing the whole model every sync is the cost.

The trainer's side (`DeltaPublisher`, in its actor): a CPU copy of the bytes last published per
tensor, first read from the engines' own checkpoint (the model path they started from, so the
base is what they hold even where the trainer's export of it is not byte-exact), in that
checkpoint's dtype. Each sync writes `weight_v{N:06d}/` under the shared folder (--weight-sync-dir),
atomically (a temporary folder, then a rename): `index.json` and `data_*.bin`, the compressed
payloads of the changed tensors one after another. Unchanged tensors are left out. The index says,
per changed tensor, its dtype and shape (safetensors' codes), the encoding, where its payload lies,
and the checksum of its new bytes; for the version: the version it applies on (`base`, None for the
seed checkpoint), the publisher's `chain` (one per trainer start), the seed folder, the compression
(zstd level 1, or zlib level 1 where `zstandard` is missing) and the density (changed bytes / all
bytes). The last --weight-delta-keep-versions versions stay on disk.

Encodings (--weight-delta-encoding), both byte-level:
- xor: new ^ old. Small (unchanged bytes are zeros), but applying it twice reverts it: it must be
  applied exactly once, on the right base, which the version record below guarantees.
- overwrite: the changed byte positions (as gaps, uint32 or uint64) then their new values.
  Larger; applying it again changes nothing.
Checksums (--weight-delta-checksum): xxh3-128 (the `xxhash` package), blake3 (`blake3`), adler32
(zlib, always there).

The engine's side (`apply_weight_delta`, shared by the embedded engine and agentrl's SGLang
wrapper, agentrl.engines.sglang_server, as POST /agentrl/apply_weight_delta): under a lock on the
local folder (--weight-sync-local-dir; engines of one host share it), seed it from the chain's seed
folder when it is empty or holds another chain (a copy of the top-level files), then apply every
version from the one it records to the one asked for, in order, each tensor patched in its
safetensors file in place (the header gives each tensor's byte offsets) and its checksum verified;
then record the version (written atomically). A missing version, a base that does not match, a
tensor whose dtype or shape differ, or a checksum that fails is an error naming them. A record
left mid-apply (a crash, or a failed checksum) makes the next call seed again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
import uuid
import zlib
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from agentrl.errors import ConfigError, EngineError

log = logging.getLogger("agentrl.weight_delta")

FORMAT = 1
INDEX = "index.json"
STATE = ".agentrl_delta.json"  # in the local checkpoint: which chain and version it holds
LOCK = ".agentrl_delta.lock"
ENCODINGS = ("xor", "overwrite")
CHECKSUMS = ("xxh3-128", "blake3", "adler32")
DATA_FILE_BYTES = 1 << 30  # payloads go to a new data_*.bin past this
APPLY_ROUTE = "/agentrl/apply_weight_delta"


class DeltaError(EngineError):
    """A delta version an engine host cannot apply: missing, on another base, corrupt. (What the
    trainer's side refuses is a ConfigError: a sync error is an engine's, which leaves the pool.)"""


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"weight_v{version:06d}"


# ---------------------------------------------------------------- checksums and compression

def check_checksum(name: str) -> None:
    """Raise, naming the package to install, when checksum `name` cannot be computed here."""
    if name not in CHECKSUMS:
        raise ValueError(f"checksum {name!r}: choose from {', '.join(CHECKSUMS)}")
    package = {"xxh3-128": "xxhash", "blake3": "blake3"}.get(name)
    if package:
        try:
            __import__(package)
        except ImportError:
            raise DeltaError(f"checksum {name} needs the `{package}` package (pip install {package}); or use "
                             "--weight-delta-checksum adler32 (zlib's)") from None


def checksum(name: str, data) -> str:
    """The hex digest of `data` (bytes or a buffer) by algorithm `name` (CHECKSUMS)."""
    check_checksum(name)
    if name == "xxh3-128":
        import xxhash

        return xxhash.xxh3_128_hexdigest(data)
    if name == "blake3":
        import blake3

        return blake3.blake3(data).hexdigest()
    return f"{zlib.adler32(data) & 0xFFFFFFFF:08x}"


def default_compression() -> str:
    import importlib.util

    return "zstd-1" if importlib.util.find_spec("zstandard") else "zlib-1"


def compress(kind: str, data) -> bytes:
    if kind == "zstd-1":
        import zstandard

        return zstandard.ZstdCompressor(level=1).compress(data)
    if kind == "zlib-1":
        return zlib.compress(data, 1)
    raise DeltaError(f"compression {kind!r}: agentrl writes zstd-1 or zlib-1")


def decompress(kind: str, data: bytes, size: int) -> bytes:
    if kind == "zstd-1":
        try:
            import zstandard
        except ImportError:
            raise DeltaError("this delta is zstd-compressed: the engine host needs the `zstandard` package") from None
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
    if kind == "zlib-1":
        return zlib.decompress(data)
    raise DeltaError(f"compression {kind!r}: agentrl reads zstd-1 or zlib-1")


# ---------------------------------------------------------------- the byte encodings

def encode(encoding: str, old: np.ndarray, new: np.ndarray) -> tuple[bytes, dict[str, Any]] | None:
    """The payload turning `old` into `new` (uint8 arrays of one length), with what its index entry
    needs; None when they are equal."""
    changed = old != new
    count = int(np.count_nonzero(changed))
    if count == 0:
        return None
    if encoding == "xor":
        return np.bitwise_xor(old, new).tobytes(), {"changed_bytes": count}
    if encoding != "overwrite":
        raise ValueError(f"encoding {encoding!r}: choose from {', '.join(ENCODINGS)}")
    positions = np.flatnonzero(changed)
    width = np.uint32 if old.size < 2**32 else np.uint64
    gaps = np.diff(positions, prepend=0).astype(width)  # sorted positions as gaps: small, they compress
    return gaps.tobytes() + new[positions].tobytes(), {"changed_bytes": count, "position_bytes": gaps.itemsize}


def apply(encoding: str, target: np.ndarray, payload: bytes, entry: dict[str, Any]) -> None:
    """Apply one tensor's payload to `target` (its current bytes, a writable uint8 array) in place."""
    if encoding == "xor":
        delta = np.frombuffer(payload, dtype=np.uint8)
        if delta.size != target.size:
            raise DeltaError(f"xor payload of {delta.size} bytes for a tensor of {target.size}")
        np.bitwise_xor(target, delta, out=target)
        return
    if encoding != "overwrite":
        raise DeltaError(f"encoding {encoding!r}: agentrl reads {', '.join(ENCODINGS)}")
    count, width = int(entry["changed_bytes"]), int(entry["position_bytes"])
    if len(payload) != count * (width + 1):
        raise DeltaError(f"overwrite payload of {len(payload)} bytes for {count} changed bytes")
    gaps = np.frombuffer(payload, dtype=np.uint32 if width == 4 else np.uint64, count=count)
    positions = np.cumsum(gaps, dtype=np.uint64)
    if count and int(positions[-1]) >= target.size:
        raise DeltaError(f"overwrite position {int(positions[-1])} past a tensor of {target.size} bytes")
    target[positions] = np.frombuffer(payload, dtype=np.uint8, offset=count * width)


# ---------------------------------------------------------------- safetensors files

def safetensors_layout(folder: str | Path, error: type[Exception] = DeltaError) -> dict[str, dict[str, Any]]:
    """Tensor name -> {file, start (absolute byte offset), nbytes, dtype (safetensors' code), shape}
    over the folder's *.safetensors files (the header gives each tensor's offsets)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise error(f"{folder}: no *.safetensors files (delta sync patches safetensors checkpoints)")
    out = {}
    for path in files:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            begin, end = meta["data_offsets"]
            out[name] = {"file": path.name, "start": 8 + size + begin, "nbytes": end - begin, "dtype": meta["dtype"],
                         "shape": list(meta["shape"])}
    return out


def _read(path: Path, start: int, nbytes: int) -> np.ndarray:
    buf = bytearray(nbytes)
    with open(path, "rb") as f:
        f.seek(start)
        if f.readinto(buf) != nbytes:
            raise DeltaError(f"{path}: truncated at byte {start}")
    return np.frombuffer(buf, dtype=np.uint8)


def _torch_dtype(code: str, error: type[Exception] = DeltaError):
    import torch

    codes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
    if code not in codes:
        raise error(f"safetensors dtype {code}: not one delta sync handles")
    return codes[code]


def _write_json(path: Path, data: dict) -> None:
    """Atomically: readers see the old file or the new one, never half of one."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


# ---------------------------------------------------------------- the trainer's side

class DeltaPublisher:
    """The trainer's side: the bytes last published per tensor, and the versions written."""

    def __init__(self, root: str | Path, *, seed: str | Path, encoding: str = "xor", checksum_name: str = "xxh3-128",
                 keep: int = 4):
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding {encoding!r}: choose from {', '.join(ENCODINGS)}")
        check_checksum(checksum_name)
        self.root, self.seed = Path(root), Path(seed)
        self.encoding, self.checksum_name, self.keep = encoding, checksum_name, max(1, keep)
        self.compression = default_compression()
        self.chain = uuid.uuid4().hex  # the engines' records name it: another trainer start, another chain
        self.layout: dict[str, dict[str, Any]] = {}  # the seed checkpoint's tensors: dtype, shape
        self.snapshot: dict[str, np.ndarray] = {}  # name -> the bytes last published (uint8), read lazily
        self.published: int | None = None  # the last version written; None: only the seed

    def _base(self, name: str) -> np.ndarray:
        if name not in self.snapshot:
            where = self.layout.get(name)
            if where is None:
                raise ConfigError(f"delta sync: the trainer's tensor {name} is not in the engines' checkpoint "
                                 f"{self.seed} (its *.safetensors), which the deltas patch in place")
            self.snapshot[name] = _read(self.seed / where["file"], where["start"], where["nbytes"])
        return self.snapshot[name]

    def publish(self, named: Iterable[tuple[str, Any]], version: int) -> dict[str, float]:
        """Write version `version` (the trainer's tensors in HF names; torch tensors on any device)
        as the bytes changed since the last published one. Returns the sync's metrics."""
        t0 = time.perf_counter()
        if not self.layout:
            self.layout = safetensors_layout(self.seed, error=ConfigError)
        if self.published is not None and version <= self.published:
            raise ValueError(f"delta sync: version {version} after version {self.published}: versions only go forward")
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".weight_v{version:06d}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        tensors, updates = {}, []
        changed = total = wire = 0
        data, data_count, offset = None, 0, 0
        try:
            for name, tensor in named:
                base = self._base(name)
                where = self.layout[name]
                dtype = _torch_dtype(where["dtype"], error=ConfigError)
                if list(tensor.shape) != where["shape"]:
                    raise ConfigError(f"delta sync: {name} has shape {list(tensor.shape)} in the trainer, "
                                     f"{where['shape']} in {self.seed}")
                new = tensor.detach().to(device="cpu", dtype=dtype).contiguous().reshape(-1).view(_torch_dtype("U8"))
                new = new.numpy()
                total += new.size
                coded = encode(self.encoding, base, new)
                if coded is None:
                    continue
                payload, entry = coded
                packed = compress(self.compression, payload)
                if data is None or offset >= DATA_FILE_BYTES:
                    if data is not None:
                        data.close()
                    data, offset = open(tmp / f"data_{data_count:05d}.bin", "wb"), 0
                    data_count += 1
                data.write(packed)
                tensors[name] = {"dtype": where["dtype"], "shape": where["shape"], "encoding": self.encoding,
                                 "file": Path(data.name).name, "offset": offset, "length": len(packed),
                                 "payload_bytes": len(payload), "checksum": checksum(self.checksum_name, new),
                                 **entry}
                offset += len(packed)
                changed += entry["changed_bytes"]
                wire += len(packed)
                updates.append((name, new.copy()))  # the tensor's memory may be reused by the export
            if data is not None:
                data.close()
                data = None
            index = {"format": FORMAT, "version": version, "base": self.published, "chain": self.chain,
                     "seed": str(self.seed), "compression": self.compression, "checksum": self.checksum_name,
                     "encoding": self.encoding, "changed_bytes": changed, "total_bytes": total,
                     "density": changed / total if total else 0.0, "wire_bytes": wire, "tensors": tensors}
            (tmp / INDEX).write_text(json.dumps(index, indent=1))
            final = version_dir(self.root, version)
            if final.exists():  # another chain's version of that number (an earlier run in this folder)
                old = final.with_name(f".{final.name}.old{os.getpid()}")
                os.replace(final, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, final)
        except BaseException:
            if data is not None:
                data.close()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for name, new in updates:  # only once the version is on disk: a failed one leaves the base as it was
            self.snapshot[name] = new
        self.published = version
        self._prune()
        return {"weight_sync_delta_density": index["density"],
                "weight_sync_delta_mb": wire / 2**20, "weight_sync_delta_tensors": float(len(tensors)),
                "weight_sync_publish_s": time.perf_counter() - t0}

    def _prune(self) -> None:
        """Keep this chain's newest `keep` versions; remove older ones and other chains'."""
        mine = []
        for folder in self.root.glob("weight_v*"):
            try:
                index = json.loads((folder / INDEX).read_text())
            except (OSError, ValueError):
                index = {}
            if index.get("chain") == self.chain:
                mine.append((index["version"], folder))
            else:
                shutil.rmtree(folder, ignore_errors=True)
        for _, folder in sorted(mine)[:-self.keep]:
            shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------- the engine's side

def read_index(root: str | Path, version: int) -> dict[str, Any]:
    path = version_dir(root, version) / INDEX
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        kept = sorted(int(p.name.removeprefix("weight_v")) for p in Path(root).glob("weight_v*")
                      if p.name.removeprefix("weight_v").isdigit())
        raise DeltaError(f"delta version {version} is not in {root} (kept there: {kept or 'none'})") from None
    if index.get("format") != FORMAT:
        raise DeltaError(f"{path}: format {index.get('format')}, this agentrl reads format {FORMAT}")
    return index


@contextlib.contextmanager
def _locked(folder: Path):
    """Engines of one host share the local checkpoint: one applies at a time."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _seed(local: Path, seed: Path, state: dict | None) -> None:
    """Make `local` a copy of the seed checkpoint's top-level files (never links: they are patched)."""
    if state is None and any(p.name != LOCK for p in local.iterdir()):
        raise DeltaError(f"local checkpoint {local} is not empty and holds no delta record ({STATE}): give an empty "
                         "folder (or one agentrl seeded), it is filled from the engines' model path")
    if not seed.is_dir():
        raise DeltaError(f"cannot seed {local}: the seed checkpoint {seed} is not a folder on this host")
    _write_json(local / STATE, {"seeding": True})  # ours from now on: an interrupted seed starts over
    for p in local.iterdir():
        if p.name not in (LOCK, STATE):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    for p in seed.iterdir():
        if p.is_file():
            shutil.copyfile(p, local / p.name)
    log.info("seeded %s from %s", local, seed)


def apply_weight_delta(delta_dir: str | Path, local_dir: str | Path, version: int) -> dict[str, Any]:
    """Bring the local checkpoint `local_dir` to version `version` of the deltas in `delta_dir`
    (the module docstring says how). Returns what was done: {"version", "applied": [versions],
    "seeded", "seconds"}."""
    t0 = time.perf_counter()
    root, local = Path(delta_dir), Path(local_dir)
    target = read_index(root, version)
    with _locked(local):
        try:
            state = json.loads((local / STATE).read_text())
        except FileNotFoundError:
            state = None
        seeded = False
        if state is None or state.get("chain") != target["chain"] or state.get("seeding") or state.get("applying"):
            if state is not None and state.get("applying") is not None:
                log.warning("%s was left mid-apply of version %s: seeding it again", local, state["applying"])
            _seed(local, Path(target["seed"]), state)
            state, seeded = {"chain": target["chain"], "version": None}, True
            _write_json(local / STATE, state)
        have = state["version"]
        if have is not None and have > version:
            raise DeltaError(f"{local} holds version {have}, newer than version {version} asked for: deltas only go "
                             "forward")
        path, index = [], target
        while index["version"] != have:  # back from the target along each version's base
            path.append(index)
            base = index["base"]
            if base == have:
                break
            if base is None or (have is not None and base < have):
                raise DeltaError(f"delta version {version} does not build on version {have}, which {local} holds "
                                 f"(its chain goes back to {'the seed' if base is None else base} without it)")
            try:
                index = read_index(root, base)
            except DeltaError as exc:
                raise DeltaError(f"{local} holds version {have}; reaching version {version} needs version {base}: "
                                 f"{exc}") from None
            if index["chain"] != target["chain"]:
                raise DeltaError(f"{version_dir(root, base)} belongs to another trainer start than version {version}")
        for index in reversed(path):
            _apply_version(root, local, index, state)
    return {"version": version, "applied": [i["version"] for i in reversed(path)], "seeded": seeded,
            "seconds": time.perf_counter() - t0}


def _apply_version(root: Path, local: Path, index: dict[str, Any], state: dict[str, Any]) -> None:
    folder = version_dir(root, index["version"])
    if index["base"] != state["version"]:
        raise DeltaError(f"{folder} applies on version {index['base']}, {local} holds version {state['version']}")
    layout = safetensors_layout(local)
    _write_json(local / STATE, {**state, "applying": index["version"]})  # a crash from here: seed again
    for name, entry in index["tensors"].items():
        where = layout.get(name)
        if where is None:
            raise DeltaError(f"{folder}: tensor {name} is not in the local checkpoint {local}")
        if (where["dtype"], where["shape"]) != (entry["dtype"], entry["shape"]):
            raise DeltaError(f"{folder}: tensor {name} is {entry['dtype']} {entry['shape']} in the delta, "
                             f"{where['dtype']} {where['shape']} in {local / where['file']}")
        with open(folder / entry["file"], "rb") as f:
            f.seek(entry["offset"])
            packed = f.read(entry["length"])
        try:
            payload = decompress(index["compression"], packed, entry["payload_bytes"])
        except DeltaError:
            raise
        except Exception as exc:
            raise DeltaError(f"{folder / entry['file']}: tensor {name}'s payload does not decompress: {exc}") from None
        target = _read(local / where["file"], where["start"], where["nbytes"])
        apply(entry["encoding"], target, payload, entry)
        got = checksum(index["checksum"], target)
        if got != entry["checksum"]:
            raise DeltaError(f"{folder / entry['file']}: tensor {name} fails its {index['checksum']} checksum after "
                             f"applying version {index['version']} ({got} != {entry['checksum']}): a corrupt payload "
                             f"or a wrong base; {local} will be seeded again")
        with open(local / where["file"], "r+b") as f:
            f.seek(where["start"])
            f.write(target.data)
    state["version"] = index["version"]
    _write_json(local / STATE, state)


async def serve_apply(body: dict) -> tuple[int, dict[str, Any]]:
    """POST /agentrl/apply_weight_delta on either engine: {"delta_dir", "local_dir", "version"} ->
    (HTTP status, reply); the file work runs in a thread, so the engine keeps serving."""
    import asyncio

    try:
        args = (str(body["delta_dir"]), str(body["local_dir"]), int(body["version"]))
    except (KeyError, TypeError, ValueError):
        return 400, {"success": False, "message": "delta_dir, local_dir (folders) and version (int) are required"}
    try:
        done = await asyncio.to_thread(apply_weight_delta, *args)
    except (DeltaError, OSError, ValueError, KeyError) as exc:
        return 400, {"success": False, "message": f"{type(exc).__name__}: {exc}"}
    return 200, {"success": True, "message": f"local checkpoint at version {args[2]}", **done}
