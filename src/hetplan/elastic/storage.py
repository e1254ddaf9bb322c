"""The shard store (a local directory, or any fsspec URL such as s3://) and async uploads.

Layout is the runtime's checkpoint format: ``step_XXXXXXXX/<unit>.pt``, the manifest written
last (a step is complete once its manifest exists), ``latest`` naming the newest complete
step, and ``placement/step_XXXXXXXX.json`` recording which node holds which shard.
"""

from __future__ import annotations

import json
import queue
import shutil
import threading
from pathlib import Path
from typing import Any

from hetplan.runtime.checkpoint import LATEST, MANIFEST, sha256_file, step_dir_name, write_atomic


class ShardStore:
    """Checkpoint shards in a directory or at an fsspec URL."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.fs: Any = None
        if "://" in url and not url.startswith("file://"):
            import fsspec

            self.fs = fsspec.filesystem(url.split("://", 1)[0])
        else:
            self.url = url.removeprefix("file://")

    def _path(self, *parts: str) -> str:
        return "/".join([self.url, *parts])

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Writes ``data`` at ``rel`` (atomically on a local disk)."""
        if self.fs is None:
            path = Path(self._path(rel))
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, data)
        else:
            self.fs.pipe(self._path(rel), data)

    def read_bytes(self, rel: str) -> bytes | None:
        """Returns the bytes at ``rel``, or None when absent."""
        try:
            if self.fs is None:
                return Path(self._path(rel)).read_bytes()
            data: bytes = self.fs.cat(self._path(rel))
            return data
        except (FileNotFoundError, OSError):
            return None

    def put(self, step: int, name: str, src: Path) -> None:
        """Uploads the local file ``src`` as shard ``name`` of ``step``."""
        rel = f"{step_dir_name(step)}/{name}"
        if self.fs is None:
            dest = Path(self._path(rel))
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.part")
            shutil.copyfile(src, tmp)
            tmp.replace(dest)
        else:
            self.fs.put_file(str(src), self._path(rel))

    def get(self, step: int, name: str, dest: Path) -> None:
        """Downloads shard ``name`` of ``step`` to the local file ``dest`` (atomically)."""
        rel = f"{step_dir_name(step)}/{name}"
        tmp = dest.with_name(f".{dest.name}.part")
        if self.fs is None:
            shutil.copyfile(self._path(rel), tmp)
        else:
            self.fs.get_file(self._path(rel), str(tmp))
        tmp.replace(dest)

    def has(self, step: int, name: str) -> bool:
        """Returns whether shard ``name`` of ``step`` is in the store."""
        rel = self._path(step_dir_name(step), name)
        return Path(rel).is_file() if self.fs is None else bool(self.fs.exists(rel))

    def manifest(self, step: int) -> dict[str, Any] | None:
        """Returns the manifest of a complete step, or None."""
        data = self.read_bytes(f"{step_dir_name(step)}/{MANIFEST}")
        return None if data is None else dict(json.loads(data))

    def commit(self, manifest: dict[str, Any]) -> None:
        """Writes a step's manifest (its files are uploaded) and moves 'latest' forward to it."""
        step = int(manifest["step"])
        self.write_bytes(f"{step_dir_name(step)}/{MANIFEST}", json.dumps(manifest).encode())
        current = self.latest_step()
        if current is None or current < step:
            self.write_bytes(LATEST, (step_dir_name(step) + "\n").encode())

    def latest_step(self) -> int | None:
        """Returns the newest complete step, or None."""
        data = self.read_bytes(LATEST)
        if data is None:
            return None
        return int(data.decode().strip().removeprefix("step_"))

    def write_placement(self, step: int, data: bytes) -> None:
        """Writes the placement record of ``step``."""
        self.write_bytes(f"placement/{step_dir_name(step)}.json", data)

    def read_placement(self, step: int) -> bytes | None:
        """Returns the placement record of ``step``, or None."""
        return self.read_bytes(f"placement/{step_dir_name(step)}.json")


class Uploader:
    """Uploads files to a store on a background thread; ``wait`` returns what was uploaded."""

    def __init__(self, store: ShardStore) -> None:
        self.store = store
        self._queue: queue.Queue[tuple[int, str, Path] | None] = queue.Queue()
        self._done: dict[str, str] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="shard-upload")
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is not None:
                    step, name, src = item
                    self.store.put(step, name, src)
                    self._done[name] = sha256_file(src)
            except BaseException as exc:  # reported by wait(), on the training thread
                self._error = exc
            finally:
                self._queue.task_done()
            if item is None:
                return

    def submit(self, step: int, name: str, src: Path) -> None:
        """Queues ``src`` for upload as shard ``name`` of ``step``."""
        self._queue.put((step, name, src))

    def wait(self) -> dict[str, str]:
        """Blocks until every queued upload is done; returns and clears name -> SHA-256."""
        self._queue.join()
        if self._error is not None:
            raise RuntimeError(f"upload to {self.store.url} failed: {self._error}")
        done, self._done = self._done, {}
        return done

    def close(self) -> None:
        """Finishes the queued uploads and stops the thread."""
        self._queue.put(None)
        self._thread.join()
