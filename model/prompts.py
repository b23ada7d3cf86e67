"""Prompts as data, apart from the encoder that reads them (and the transformers import it costs): the errors
a prompt raises, its token bound, and the LRU cache of prompt embeddings the text encoder stage keeps. The
ingress validates requests and reports these stats without loading Qwen3-VL."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from model.presentation import Presentation
    from model.text_encoder import PromptEncoder


class PromptError(ValueError):
    """A prompt the encoder cannot condition on; the message names the value and the limit."""


class EmptyPromptError(PromptError):
    pass


class PromptTooLongError(PromptError):
    pass


class PromptEncoding(Protocol):
    """What `PromptEmbeddingCache.get_or_encode` needs from an encoder."""

    @property
    def identity(self) -> str: ...

    def encode(self, prompt: str, *, max_tokens: int | None = None) -> torch.Tensor: ...


def check_token_count(num_tokens: int, max_tokens: int | None) -> None:
    if max_tokens is not None and num_tokens > max_tokens:
        raise PromptTooLongError(f"prompt has {num_tokens} tokens, more than the limit of {max_tokens}")


@dataclass(frozen=True)
class PromptKey:
    encoder_identity: str
    prompt: str
    media_hash: str = ""  # a keyframe / reference presentation: the content hash of its images ("" for text)


@dataclass(frozen=True)
class PromptCacheStats:
    hits: int
    misses: int
    evictions: int
    entries: int
    used_bytes: int
    capacity_bytes: int


class PromptEmbeddingCache:
    """Prompt embeddings by (encoder identity, prompt), least recently used evicted first, bounded by bytes.

    Invariants (checked after every change): used_bytes == the sum of the entries' bytes <= capacity_bytes.
    An embedding larger than the whole capacity is returned but not kept. Entries are the encoder's own
    tensors (not copies): callers must not modify them in place. Thread-safe; two concurrent misses on one
    prompt both encode and the second insert wins.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[PromptKey, torch.Tensor] = OrderedDict()  # least recently used first
        self._used_bytes = 0
        self._hits = self._misses = self._evictions = 0
        self._lock = threading.Lock()

    def lookup(self, key: PromptKey) -> torch.Tensor | None:
        """The cached embedding (now the most recently used), or None; counts a hit or a miss."""
        with self._lock:
            embedding = self._entries.get(key)
            if embedding is None:
                self._misses += 1
                return None
            self._hits += 1
            self._entries.move_to_end(key)
            return embedding

    def insert(self, key: PromptKey, embedding: torch.Tensor) -> bool:
        """Keep `embedding` under `key`, evicting least recently used entries to make room; False if it is
        larger than the capacity (then nothing is evicted)."""
        size = embedding.numel() * embedding.element_size()
        with self._lock:
            if size > self.capacity_bytes:
                return False
            previous = self._entries.pop(key, None)
            if previous is not None:
                self._used_bytes -= previous.numel() * previous.element_size()
            while self._used_bytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._used_bytes -= evicted.numel() * evicted.element_size()
                self._evictions += 1
            self._entries[key] = embedding
            self._used_bytes += size
            self._check()
            return True

    def get_or_encode(self, encoder: PromptEncoding, prompt: str, *, max_tokens: int | None = None) -> torch.Tensor:
        """The cached embedding of `prompt` by `encoder`, encoding (and caching) it on a miss. `max_tokens` is
        enforced on hits too."""
        return self._get_or_make(PromptKey(encoder.identity, prompt),
                                 lambda: encoder.encode(prompt, max_tokens=max_tokens), max_tokens)

    def get_or_encode_presentation(self, encoder: PromptEncoder, presentation: Presentation, *,
                                   max_tokens: int | None = None) -> torch.Tensor:
        """As `get_or_encode`, for a keyframe / reference presentation; keyed by its images' content hash too
        (the same prompt with other images is another entry)."""
        return self._get_or_make(PromptKey(encoder.identity, presentation.prompt, presentation.media_hash),
                                 lambda: encoder.encode_presentation(presentation, max_tokens=max_tokens), max_tokens)

    def _get_or_make(self, key: PromptKey, encode: Callable[[], torch.Tensor], max_tokens: int | None) -> torch.Tensor:
        embedding = self.lookup(key)
        if embedding is None:
            embedding = encode()  # the encoder enforces max_tokens on what it encodes
            self.insert(key, embedding)
        else:
            check_token_count(embedding.shape[0], max_tokens)
        return embedding

    def stats(self) -> PromptCacheStats:
        with self._lock:
            return PromptCacheStats(hits=self._hits, misses=self._misses, evictions=self._evictions,
                                    entries=len(self._entries), used_bytes=self._used_bytes,
                                    capacity_bytes=self.capacity_bytes)

    def clear(self) -> None:
        """Drop every entry (the hit/miss/eviction counters are kept)."""
        with self._lock:
            self._entries.clear()
            self._used_bytes = 0

    def _check(self) -> None:
        total = sum(e.numel() * e.element_size() for e in self._entries.values())
        if total != self._used_bytes or self._used_bytes > self.capacity_bytes:
            raise AssertionError(f"prompt cache bookkeeping broken: used_bytes {self._used_bytes}, entries hold "
                                 f"{total}, capacity {self.capacity_bytes}")
