"""engine.wire: tensors crossing processes travel as numpy bytes and come back bit-equal, as CPU tensors that own
their memory; the dataclasses that cross Serve hops (prompt embeddings, results, latents) opt in."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from engine.api import GenerationResult, Latents
from engine.stage_data import PromptEmbedding
from engine.wire import TensorsAsArrays, WireTensor
from model.prompts import PromptCacheStats
from tests.serve_helpers import shared_ray

pytestmark = pytest.mark.ray  # one test moves tensors through the session's cluster

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool, torch.complex64)


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(shape, generator=generator, dtype=torch.float64) * 100
    if dtype.is_complex:
        return torch.complex(values, -values).to(dtype)
    return values.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 0, 2), (4, 5, 6)], ids=str)
def test_a_tensor_comes_back_bit_equal_with_its_dtype_and_shape(dtype, shape):
    tensor = sample(dtype, shape)
    back = pickle.loads(pickle.dumps(WireTensor.of(tensor), protocol=5)).tensor()
    assert back.dtype == dtype and back.shape == tensor.shape and back.device.type == "cpu"
    assert torch.equal(back.view(-1).view(torch.uint8) if back.numel() else back,
                       tensor.view(-1).view(torch.uint8) if tensor.numel() else tensor)


def test_views_travel_as_their_values():
    base = sample(torch.float32, (6, 8))
    for view in (base.t(), base[:, 1::3], base[2:4].expand(3, 2, 8), base.unsqueeze(0)[..., ::2]):
        assert torch.equal(WireTensor.of(view).tensor(), view)


def test_the_array_is_an_out_of_band_buffer_and_the_tensor_owns_a_copy():
    tensor = sample(torch.bfloat16, (64, 32))
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(WireTensor.of(tensor), protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and buffers[0].raw().nbytes == tensor.numel() * 2
    assert len(stream) < 1024  # the bytes are not in the pickle stream
    received = bytearray(buffers[0].raw())
    readonly = np.frombuffer(bytes(received), dtype=np.uint8)  # what an object store hands back: read-only
    wire = pickle.loads(stream, buffers=[readonly])
    back = wire.tensor()
    back.add_(1)  # writable, and not over the received buffer
    assert not readonly.flags.writeable and bytes(readonly) == bytes(received)


def test_an_unknown_dtype_name_is_refused():
    wire = WireTensor(np.zeros(4, dtype=np.uint8), "Tensor", (4,))
    with pytest.raises(ValueError, match="not a torch dtype"):
        wire.tensor()


def test_the_crossing_dataclasses_pickle_their_tensors_as_arrays_and_nothing_else_changes():
    stats = PromptCacheStats(hits=1, misses=2, evictions=0, entries=3, used_bytes=4, capacity_bytes=5)
    embedding = PromptEmbedding(embeds=sample(torch.bfloat16, (9, 16)), encode_s=0.5, cache=stats)
    latents = Latents(video=sample(torch.float32, (4, 2, 3, 5)), audio=sample(torch.float32, (6, 8)))
    for value in (embedding, latents):
        assert isinstance(value, TensorsAsArrays)
        buffers: list[pickle.PickleBuffer] = []
        stream = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
        assert len(buffers) == len([v for v in vars(value).values() if isinstance(v, torch.Tensor)])
        back = pickle.loads(stream, buffers=buffers)
        assert type(back) is type(value)
        for name, field in vars(value).items():
            if isinstance(field, torch.Tensor):
                assert torch.equal(getattr(back, name), field) and getattr(back, name).dtype == field.dtype
            else:
                assert getattr(back, name) == field
    assert issubclass(GenerationResult, TensorsAsArrays)


@pytest.mark.slow  # Ray
def test_ray_moves_them_through_its_object_store_into_tensors_of_their_own():
    import ray

    embedding = PromptEmbedding(embeds=sample(torch.bfloat16, (300, 64)), encode_s=0.0,
                                cache=PromptCacheStats(hits=0, misses=1, evictions=0, entries=1, used_bytes=1, capacity_bytes=1))
    with shared_ray():  # the session's cluster (tests/serve_helpers.py)
        back = ray.get(ray.put(embedding))
    assert torch.equal(back.embeds, embedding.embeds)
    back.embeds.add_(1)  # its own memory, not the store's read-only buffer
