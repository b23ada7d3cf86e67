"""Cold LoRA adapters read off the generation thread: one loader thread reads, converts and checks a file while the
engine thread keeps denoising the running request; the request that needs the adapter waits for it when it starts.

`AdapterLoader(read)`: `prefetch(name)` (any thread, never waits) starts `read(name)` on the loader thread unless it is
loading or loaded already; `take(name, cancelled)` (the engine thread) returns the loaded file, waiting for a load
in flight (starting one if none was) and raising `GenerationCancelled` within `POLL_S` once `cancelled()` turns
true; a read's error (`AdapterError` naming the file) is raised to the request taking it. `loading` lists the names
prefetched and not taken: what the replica reports as held to the router (they will be by the time the request
routed for them runs). The read is the slow part (the file from the page cache, diffusers' conversion, the checks
against the model: read-only); installing the factors into the transformer stays on the engine thread between
requests, where no forward is running (peft's injection swaps modules and changes which adapters are active).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

from engine.api import CancelledFn
from engine.errors import GenerationCancelled
from model.adapters import LoraFile

#: How often a request waiting for its adapter checks whether it was cancelled (seconds).
POLL_S = 0.05


class AdapterLoader:
    """One loader thread over `read(name) -> LoraFile`. Thread-safe."""

    def __init__(self, read: Callable[[str], LoraFile]):
        self._read = read
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-loader")
        self._lock = threading.Lock()
        self._loads: dict[str, Future[LoraFile]] = {}  # prefetched, not taken yet

    @property
    def loading(self) -> tuple[str, ...]:
        """Names prefetched and not taken yet (in flight or done)."""
        with self._lock:
            return tuple(self._loads)

    def prefetch(self, name: str) -> None:
        """Start reading `name` on the loader thread unless it is already prefetched."""
        with self._lock:
            if name not in self._loads:
                self._loads[name] = self._executor.submit(self._read, name)

    def take(self, name: str, cancelled: CancelledFn | None = None) -> LoraFile:
        """The file of `name`, once read (its read started now if it was not prefetched). GenerationCancelled when
        `cancelled()` turns true while waiting: the read goes on and stays prefetched for the next request."""
        self.prefetch(name)
        with self._lock:
            future = self._loads[name]
        while True:
            if cancelled is not None and cancelled():
                raise GenerationCancelled("generation cancelled by the caller while its adapter was loading")
            try:
                lora = future.result(timeout=POLL_S)
            except FutureTimeout:
                continue
            except BaseException:
                self.discard(name, future)  # a failed read is not kept: the next request reads the file again
                raise
            self.discard(name, future)
            return lora

    def discard(self, name: str, future: Future[LoraFile] | None = None) -> None:
        """Forget `name`'s prefetched read (only `future`'s, when given)."""
        with self._lock:
            if name in self._loads and (future is None or self._loads[name] is future):
                del self._loads[name]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
