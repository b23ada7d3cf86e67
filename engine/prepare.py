"""The prepare side of a split app: a request's prompt, keyframes and references -> the denoiser's input.

    stage = prepare_stage(config, partitions=("fl2va", "ref2va"))
    tokens = stage.check(request)       # cheap: the prompt's tokens; the uploads decoded, the canvas resolved
    embedding = stage.encode(request)   # PromptEmbedding; fl2va / ref2va: with its `Conditions`

What runs here is what a fused engine runs before its denoising loop (`engine.conditioning.ConditioningStage`:
Qwen3-VL's presentation with the vision tower, the keyframes' and references' VAE encodes), so a denoiser that holds
the transformer alone (`engine.engine.DenoiserEngine`) runs fl2va and ref2va with the same bits as a fused engine:
what it needs of the media travels in the embedding as typed data (`engine.stage_data.Conditions`). One prepare stage serves
every partition an app lists (they share the text encoder and the VAEs): it takes the tasks of them all. Loaded only
for what it serves: the vision tower and the VAE encoders only when a listed partition takes keyframes or
references and `engine.text_encoder.vision` is on (a t2va-only prepare stage keeps the text layers' memory), and of
the VAEs the encoder halves alone (`VaeEncoders.load`; the app's Decoder holds the decoder halves).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.api import GenerationRequest, Task
from engine.conditioning import ConditioningStage, checked_conditioning
from engine.config import EngineConfig
from engine.engine import resolve_device
from engine.model_limits import geometry_limits, model_limits
from engine.errors import ClientError
from engine.stage_data import PromptEmbedding
from engine.stages import PromptStage, VaeEncoders
from model.layout import H3Checkpoint, Partition
from model.provisioning import ensure_checkpoint, served_partition
from model.weights import CONFIG_FILE, H3TransformerConfig

__all__ = ["PrepareStage", "prepare_stage"]


class PrepareStage:
    """The prompt stage, and for keyframes and references the conditioning stage over the same encoder and the
    VAEs' encoder halves. Calls from one thread at a time per encode (the stages' own locking)."""

    def __init__(self, prompt: PromptStage, conditioning: ConditioningStage | None, tasks: tuple[str, ...]) -> None:
        self.prompt, self.conditioning, self.tasks = prompt, conditioning, tasks

    def check(self, request: GenerationRequest) -> int:
        """The prompt's tokens; ClientError naming the field for a task not served here, a prompt the encoder
        refuses, or a bad keyframe / reference (the uploads are decoded and the canvas resolved, no model runs)."""
        self._check_task(request)
        tokens = self.prompt.check(request.prompt)
        if request.task is not Task.T2VA:
            checked_conditioning(self.conditioning, request).check(request)
        return tokens

    @torch.no_grad()
    def encode(self, request: GenerationRequest) -> PromptEmbedding:
        """`request`'s embedding on the CPU, with its `Conditions` for fl2va / ref2va (what the denoiser takes)."""
        self._check_task(request)
        if request.task is Task.T2VA:
            return self.prompt.encode(request.prompt).cpu()
        self.prompt.check(request.prompt)
        return checked_conditioning(self.conditioning, request).encode(request).cpu()

    def _check_task(self, request: GenerationRequest) -> None:
        if request.task.value not in self.tasks:
            field = "keyframes" if request.keyframes else "references" if request.references else "prompt"
            raise ClientError(field, f"{request.task.value} is not served here (the served tasks are "
                              f"{', '.join(self.tasks)})")


def prepare_stage(config: EngineConfig, partitions: Sequence[str] | None = None) -> PrepareStage:
    """The prepare stage of an app serving `partitions` (default: `config.partition`), from `config`'s
    checkpoint (the shared text encoder, processor and VAEs)."""
    checkpoint = H3Checkpoint.open(ensure_checkpoint(config), served_partition(config), require_components=True)
    tasks = tuple(dict.fromkeys(task for partition in (partitions or (config.partition,))
                                for task in Partition(partition).tasks))
    conditioned = config.text_encoder.vision and any(task != Task.T2VA.value for task in tasks)
    engine_device = resolve_device(config.device)
    prompt = PromptStage(config.text_encoder, checkpoint, resolve_device(config.text_encoder.device, engine_device),
                         vision=conditioned)
    if not conditioned:
        return PrepareStage(prompt, None, tasks)
    # The VAEs' encoder halves alone (the keyframes' and references' latents), on the decoder's device: the app's
    # Decoder holds the decoder halves.
    vaes = VaeEncoders.load(checkpoint, resolve_device(config.decode.device, engine_device))
    path = checkpoint.transformer_dir / CONFIG_FILE
    hidden_size = H3TransformerConfig.from_json(path.read_bytes(), checkpoint.layout, path).hidden_size
    limits = geometry_limits(model_limits(config, hidden_size, tasks))
    return PrepareStage(prompt, ConditioningStage(checkpoint, prompt, vaes, limits, tasks=tasks), tasks)
