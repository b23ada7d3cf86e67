"""Prompt -> MiniMax-H3 text conditioning: Qwen3-VL `hidden_states[50]` (the cache of results: `model.prompts`).

What the reference pipeline feeds the transformer for t2va (diffusers `MiniMaxH3TextEncoderStep` and
`get_qwen3vl_prompt_embeds`): the prompt tokenized verbatim (`add_special_tokens=False`: no chat template, no
special tokens, no padding, no truncation), one Qwen3-VL forward with an all-ones attention mask, and
`hidden_states[50]`: the output of decoder layer 49, before the final norm, in the text encoder's dtype.

`PromptEncoder` loads only what feeds that: the token embedding and decoder layers 0..49 of the language model,
about 50.3 GB of the 67 GB text encoder in bfloat16 (the vision tower, layers 50.., the final norm and the LM head
are never read; vllm-omni's 51.5 GB also keeps the vision tower, which text-only prompts do not use). With the
stack cut to 50 layers, the pre-norm output of its last layer is exactly `hidden_states[50]` of the full model,
so the final norm is replaced by an identity instead of collecting every hidden state.
Tensors go straight from the safetensors files to `device` in their stored dtype (bfloat16 in the release).

Split over processes: a `LanguageModelSplit` (`parallel.text_encoder.TextTensorParallel` over a replica's ranks)
decides the per-process config (fewer heads, a narrower MLP), which slice of each tensor this process reads, and
installs what joins the partial results (an all-reduce); the encoder itself stays this one class.

Text-only prompts carry no vision tokens, so Qwen3-VL's multimodal rotary layout reduces to plain positions
0..L-1 on all three axes; the language model computes exactly that when given no position ids.

Keyframe and reference prompts (`model.presentation.Presentation`: labels, vision blocks, the prompt) need the
vision tower: `PromptEncoder(..., vision=True)` also loads `model.visual.*`, the image processor and, where the
processor directory has its config, our video processor (`model.qwen_video`), and `encode_presentation` runs
transformers' own `Qwen3VLModel` forward (vision features scattered into the pad rows, deepstack, the multimodal
rotary positions) over the same truncated language model.
Without `vision` (a t2va-only deployment) neither is loaded, and the memory is today's.
"""

from __future__ import annotations

import hashlib
import json
import struct
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from accelerate import init_empty_weights
from safetensors import SafetensorError, safe_open
from transformers import Qwen2TokenizerFast, Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel, Qwen3VLTextModel, Qwen3VLVisionModel

from model.presentation import Presentation
from model.prompts import EmptyPromptError, PromptError, check_token_count
from model.qwen_video import VIDEO_PROCESSOR_FILE, QwenVideoProcessor

#: MiniMax-H3 conditions on hidden_states[50] of its Qwen3-VL (diffusers `text_encoder_layer`).
H3_HIDDEN_STATE_INDEX = 50
#: Where a Qwen3VLForConditionalGeneration checkpoint keeps its language model's tensors.
LANGUAGE_MODEL_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
SAFETENSORS_INDEX = "model.safetensors.index.json"


class TextEncoderLoadError(ValueError):
    """A text encoder or tokenizer directory that cannot be loaded; the message names the path and the problem."""


class SafetensorsHandle(Protocol):
    """What a `LanguageModelSplit` reads a tensor, or a slice of it, through (`safetensors.safe_open`'s handle)."""

    def get_tensor(self, name: str) -> torch.Tensor: ...

    def get_slice(self, name: str): ...


class LanguageModelSplit(Protocol):
    """How this process holds only its part of the language model (e.g. `parallel.text_encoder`).

    The encoder builds the model from `local_config(config)`, reads every tensor it needs through
    `read(handle, stored_name, name)` (`name`: the model's own parameter name, e.g.
    `layers.0.self_attn.q_proj.weight`), then calls `install(model)` before the first forward. `label` becomes
    part of the encoder's identity (a split encoder rounds differently from a whole one).
    """

    @property
    def label(self) -> str: ...

    def local_config(self, config: Qwen3VLTextConfig) -> Qwen3VLTextConfig: ...

    def read(self, handle: SafetensorsHandle, stored_name: str, name: str) -> torch.Tensor: ...

    def install(self, model: Qwen3VLTextModel) -> None: ...


class LayerTransform(Protocol):
    """What the encoder applies to each decoder layer as soon as that layer's weights are on the device, before
    the next layer is read (e.g. `engine.text_fp8.TextEncoderFp8`: its linears in float8), so the stack is never
    held whole in its stored dtype. `label` becomes part of the encoder's identity (the layers compute other
    bits)."""

    @property
    def label(self) -> str: ...

    def apply(self, index: int, layer: torch.nn.Module) -> None: ...


class PromptEncoder:
    """Qwen3-VL truncated to the layers feeding `hidden_states[hidden_state_index]`, on one device.

    `encode(prompt)` -> [num_tokens, text_dim] in the checkpoint's dtype on `device`. `identity` is a 16-hex
    fingerprint of the weight files (path, size, mtime, header), the tokenizer files, the layer index and the
    split's label (no tensor data is read), so caches keyed by it never mix encoders.

    `split`: this process holds and runs only its part of the model (`LanguageModelSplit`); `encode` is then a
    collective: every process of the split must call it with the same prompt, in the same order.
    `layer_transform`: applied to each decoder layer as it is loaded (`LayerTransform`); the vision tower and the
    embedding are left as stored.
    """

    def __init__(self, text_encoder_dir: str | Path, tokenizer_dir: str | Path, device: torch.device | str, *,
                 hidden_state_index: int = H3_HIDDEN_STATE_INDEX, split: LanguageModelSplit | None = None,
                 vision: bool = False, processor_dir: str | Path | None = None,
                 layer_transform: LayerTransform | None = None) -> None:
        """`vision`: also load the vision tower and the image and video processors (`processor_dir`), for keyframe
        and reference prompts (`encode_presentation`); not with `split`."""
        self.text_encoder_dir, self.tokenizer_dir = Path(text_encoder_dir), Path(tokenizer_dir)
        self.device = torch.device(device)
        self.hidden_state_index = hidden_state_index
        self.tokenizer = _load_tokenizer(self.tokenizer_dir)
        text_config = _truncated_text_config(self.text_encoder_dir, hidden_state_index)
        if len(self.tokenizer) > text_config.vocab_size:  # another model's tokenizer: ids past the embedding
            raise TextEncoderLoadError(f"the tokenizer in {self.tokenizer_dir} has {len(self.tokenizer)} tokens, more "
                                       f"than the {text_config.vocab_size} rows of {self.text_encoder_dir}'s embedding")
        self.text_dim: int = text_config.hidden_size
        self.split = split
        try:
            weight_files = _weight_files(self.text_encoder_dir)
            self._model = _load_truncated_language_model(text_config, weight_files, self.device, split,
                                                         layer_transform)
            labels = [part.label for part in (split, layer_transform) if part is not None]
            self.identity = _fingerprint(self.text_encoder_dir, weight_files, self.tokenizer_dir, hidden_state_index,
                                         "".join(labels))
            self._multimodal: Qwen3VLModel | None = None
            self.image_processor: Qwen2VLImageProcessorPil | None = None
            self.video_processor: QwenVideoProcessor | None = None  # None: the processor has no video config
            if vision:
                if split is not None:
                    raise TextEncoderLoadError("a tensor-parallel text encoder serves text prompts only; keyframe and "
                                               "reference prompts need text_encoder_tp = 1")
                if processor_dir is None:
                    raise TextEncoderLoadError("vision=True needs the processor directory (its image processor)")
                self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(processor_dir)
                if (Path(processor_dir) / VIDEO_PROCESSOR_FILE).is_file():
                    self.video_processor = QwenVideoProcessor.from_pretrained(processor_dir)
                self._multimodal = _load_multimodal(self.text_encoder_dir, text_config, weight_files, self._model,
                                                    self.device)
        except (KeyError, json.JSONDecodeError, struct.error, OSError, SafetensorError) as e:
            # An index without weight_map, a shard cut short: the bare errors name no file.
            raise TextEncoderLoadError(f"cannot load the text encoder weights in {self.text_encoder_dir}: "
                                       f"{type(e).__name__}: {e}") from e

    @property
    def dtype(self) -> torch.dtype:
        return self._model.embed_tokens.weight.dtype

    @property
    def module(self) -> torch.nn.Module:
        """Everything the encoder holds: the language model, inside Qwen3-VL's multimodal model when the vision
        tower is loaded too."""
        return self._multimodal if self._multimodal is not None else self._model

    @property
    def num_loaded_layers(self) -> int:
        """Decoder layers held in memory (= hidden_state_index; the rest of the checkpoint is never read)."""
        return len(self._model.layers)

    def tokenize(self, prompt: str) -> list[int]:
        """The prompt's token ids, verbatim as the reference tokenizes it. Raises EmptyPromptError on 0 tokens."""
        if not isinstance(prompt, str):
            raise PromptError(f"prompt must be a string, got {type(prompt).__name__}")
        token_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not token_ids:
            raise EmptyPromptError(f"prompt {prompt!r} has no tokens: the text encoder needs at least 1")
        return token_ids

    def count_tokens(self, prompt: str) -> int:
        """How many rows `encode(prompt)` returns (for enforcing a maximum before encoding)."""
        return len(self.tokenize(prompt))

    @torch.inference_mode()
    def encode(self, prompt: str, *, max_tokens: int | None = None) -> torch.Tensor:
        """[num_tokens, text_dim]: the hidden state after decoder layer `hidden_state_index - 1`, pre-norm."""
        token_ids = self.tokenize(prompt)
        check_token_count(len(token_ids), max_tokens)
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        output = self._model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)
        return output.last_hidden_state[0]

    @property
    def has_vision(self) -> bool:
        return self._multimodal is not None

    @torch.inference_mode()
    def encode_presentation(self, presentation: Presentation, *, max_tokens: int | None = None) -> torch.Tensor:
        """[num_tokens, text_dim] of a keyframe / reference presentation: `hidden_states[index]` of Qwen3-VL's
        multimodal forward (diffusers `get_qwen3vl_prompt_embeds` with its vision inputs)."""
        if self._multimodal is None:
            raise TextEncoderLoadError("this prompt encoder was loaded without the vision tower (vision=False)")
        check_token_count(presentation.num_tokens, max_tokens)
        model = self._multimodal
        input_ids = torch.tensor([presentation.token_ids], dtype=torch.long, device=self.device)
        types = torch.zeros_like(input_ids)  # Qwen3-VL's own modality types: 1 image pad, 2 video pad
        types[input_ids == model.config.image_token_id] = 1
        types[input_ids == model.config.video_token_id] = 2
        vision = {}
        if presentation.pixel_values is not None:
            vision = {"pixel_values": presentation.pixel_values.to(self.device, self.dtype),
                      "image_grid_thw": presentation.image_grid_thw.to(self.device)}
        if presentation.pixel_values_videos is not None:
            vision |= {"pixel_values_videos": presentation.pixel_values_videos.to(self.device, self.dtype),
                       "video_grid_thw": presentation.video_grid_thw.to(self.device)}
        output = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=types,
                       use_cache=False, **vision)
        return output.last_hidden_state[0]


# --- Loading ------------------------------------------------------------------------------------------------


def _load_tokenizer(tokenizer_dir: Path) -> Qwen2TokenizerFast:
    if not tokenizer_dir.is_dir():
        raise TextEncoderLoadError(f"tokenizer directory {tokenizer_dir} does not exist")
    try:
        tokenizer = Qwen2TokenizerFast.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as e:
        raise TextEncoderLoadError(f"cannot load a Qwen2 tokenizer from {tokenizer_dir}: {e}") from None
    # Without its vocabulary files transformers still builds a tokenizer, one that gives every prompt 0 tokens:
    # each request would then be refused as the client's empty prompt.
    if not tokenizer("a", add_special_tokens=False)["input_ids"]:
        raise TextEncoderLoadError(f"{tokenizer_dir} holds no tokenizer vocabulary (tokenizer.json, or vocab.json and "
                                   f"merges.txt): it tokenizes text to nothing")
    return tokenizer


def language_model_config(text_encoder_dir: str | Path) -> Qwen3VLTextConfig:
    """The language model's config as stored (config.json only; no weights are read)."""
    text_encoder_dir = Path(text_encoder_dir)
    if not (text_encoder_dir / "config.json").is_file():
        raise TextEncoderLoadError(f"{text_encoder_dir / 'config.json'} is missing")
    return Qwen3VLConfig.from_pretrained(text_encoder_dir).text_config


def _truncated_text_config(text_encoder_dir: Path, hidden_state_index: int) -> Qwen3VLTextConfig:
    """The language model's config with only the `hidden_state_index` layers that feed the state read."""
    text_config = language_model_config(text_encoder_dir)
    num_layers = text_config.num_hidden_layers
    # hidden_states[num_layers] is the final, normed state, not a layer output; MiniMax-H3 reads a layer output.
    if not 1 <= hidden_state_index < num_layers:
        raise TextEncoderLoadError(
            f"hidden_state_index {hidden_state_index} is out of range for {text_encoder_dir}: its text model has "
            f"{num_layers} decoder layers, so the index must be in 1..{num_layers - 1}")
    return Qwen3VLTextConfig.from_dict({**text_config.to_dict(), "num_hidden_layers": hidden_state_index})


def _weight_files(text_encoder_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (sharded with an index, or a single file)."""
    index_path = text_encoder_dir / SAFETENSORS_INDEX
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        return {name: text_encoder_dir / file for name, file in weight_map.items()}
    files = sorted(text_encoder_dir.glob("*.safetensors"))
    if len(files) != 1:
        raise TextEncoderLoadError(f"{text_encoder_dir} has no {SAFETENSORS_INDEX} and {len(files)} safetensors "
                                   f"files; expected an index or exactly one file")
    with safe_open(files[0], framework="pt") as handle:
        return {name: files[0] for name in handle.keys()}


def _load_truncated_language_model(text_config: Qwen3VLTextConfig, weight_files: dict[str, Path],
                                   device: torch.device, split: LanguageModelSplit | None,
                                   transform: LayerTransform | None) -> Qwen3VLTextModel:
    if split is not None:
        text_config = split.local_config(text_config)
    with init_empty_weights():  # parameters on meta; buffers (rotary inv_freq) are computed for real
        model = Qwen3VLTextModel(text_config)
    model.norm = torch.nn.Identity()  # the state read is pre-norm (see the module docstring)
    wanted = set(model.state_dict())
    stored = {stored_name[len(LANGUAGE_MODEL_PREFIX):]: stored_name for stored_name in weight_files
              if stored_name.startswith(LANGUAGE_MODEL_PREFIX) and stored_name[len(LANGUAGE_MODEL_PREFIX):] in wanted}
    missing = sorted(wanted - set(stored))
    if missing:
        raise TextEncoderLoadError(f"text encoder weights lack {len(missing)} of the tensors needed (under "
                                   f"{LANGUAGE_MODEL_PREFIX!r}), e.g. {missing[:3]}")
    with ExitStack() as files:
        handles: dict[Path, SafetensorsHandle] = {}

        def read(name: str) -> torch.Tensor:
            path = weight_files[stored[name]]
            if path not in handles:
                handles[path] = files.enter_context(safe_open(path, framework="pt", device=str(device)))
            handle = handles[path]
            return handle.get_tensor(stored[name]) if split is None else split.read(handle, stored[name], name)

        # Layer by layer: each reaches the device and is transformed (e.g. to float8) before the next is read.
        for index, layer in enumerate(model.layers):
            prefix = f"layers.{index}."
            layer.load_state_dict({name[len(prefix):]: read(name) for name in wanted if name.startswith(prefix)},
                                  strict=True, assign=True)
            layer.requires_grad_(False)
            if transform is not None:
                transform.apply(index, layer)
        for child_name, child in model.named_children():  # the embedding (norm: identity, rotary: buffers)
            if child_name != "layers":
                prefix = f"{child_name}."
                child.load_state_dict({name[len(prefix):]: read(name) for name in wanted if name.startswith(prefix)},
                                      strict=True, assign=True)
    model = model.to(device).eval().requires_grad_(False)  # the rotary buffers (the weights are there already)
    if split is not None:
        split.install(model)
    return model


def _load_multimodal(text_encoder_dir: Path, text_config: Qwen3VLTextConfig, weight_files: dict[str, Path],
                     language_model: Qwen3VLTextModel, device: torch.device) -> Qwen3VLModel:
    """transformers' Qwen3VLModel around the truncated language model and the vision tower read from the
    checkpoint (its `model.visual.*` tensors), for its multimodal forward."""
    config = Qwen3VLConfig.from_pretrained(text_encoder_dir)
    config.text_config = text_config
    with init_empty_weights():
        visual = Qwen3VLVisionModel(config.vision_config)
        model = Qwen3VLModel(config)
    wanted = set(visual.state_dict())
    state: dict[str, torch.Tensor] = {}
    for path in sorted({path for name, path in weight_files.items() if name.startswith(VISION_PREFIX)}):
        with safe_open(path, framework="pt", device=str(device)) as handle:
            for stored_name in handle.keys():
                if stored_name.startswith(VISION_PREFIX) and stored_name[len(VISION_PREFIX):] in wanted:
                    state[stored_name[len(VISION_PREFIX):]] = handle.get_tensor(stored_name)
    missing = sorted(wanted - set(state))
    if missing:
        raise TextEncoderLoadError(f"text encoder weights lack {len(missing)} vision tensors (under "
                                   f"{VISION_PREFIX!r}), e.g. {missing[:3]}")
    visual.load_state_dict(state, strict=True, assign=True)
    model.visual = visual.to(device).eval().requires_grad_(False)
    model.language_model = language_model
    return model.eval()


def _fingerprint(text_encoder_dir: Path, weight_files: dict[str, Path], tokenizer_dir: Path,
                 hidden_state_index: int, split_label: str) -> str:
    """Which weight files (path, size, modification time, header), which tokenizer (bytes), which layer.

    Hashing 67 GB of tensor data is too slow for a cache key, so a weight file counts as changed when it is
    replaced (new mtime or size) or lives at another path; the same bytes at two paths are two encoders.
    """
    digest = hashlib.sha256(f"hidden_states[{hidden_state_index}]{split_label}".encode())
    digest.update((text_encoder_dir / "config.json").read_bytes())
    for path in sorted(set(weight_files.values())):
        stat = path.stat()
        digest.update(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        digest.update(_safetensors_header(path))
    for path in sorted(p for p in tokenizer_dir.iterdir() if p.is_file()):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _safetensors_header(path: Path) -> bytes:
    """The JSON header of a safetensors file (names, dtypes, shapes, offsets), without the tensor data."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return handle.read(length)
