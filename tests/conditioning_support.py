"""Shared by the fl2va and ref2va oracle tests: the tiny checkpoint of both partitions, diffusers' modular pipeline
over its components (the oracle), and ditserve's side composed from `model/` (prepare -> encode -> denoise)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import torch
from diffusers import AutoencoderKLMiniMaxH3Audio, MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
from diffusers.image_processor import VaeImageProcessor
from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3Blocks
from PIL import Image
from transformers import Qwen2TokenizerFast, Qwen2VLImageProcessorPil, Qwen3VLForConditionalGeneration
from transformers.processing_utils import ProcessorMixin

from model.canvas import CanvasRule
from model.conditioning import Conditioning
from model.decode import AudioDecoder, VideoDecoder
from model.denoise import denoise
from model.encode import AudioConditionEncoder, VisualConditionEncoder
from model.geometry import GeometryLimits
from model.layout import H3Checkpoint, Partition
from model.loading import load_transformer
from model.packing import audio_rows_to_channels
from model.prepare import ConditionEncoders, PreparedConditioning, prepare_conditioning
from model.qwen_video import QwenVideoProcessor
from model.text_encoder import PromptEncoder
from model.tiny import TINY_CANVAS
from model.weights import TransformerWeights

PROMPT = "A red fox runs across a snowy field at dawn."
NUM_FRAMES = 124  # 5 s: the shortest clip the pipeline takes
STEPS = 3
TINY_LIMITS = GeometryLimits(short_edge=None, max_pixels=128 * 128)


class StandInProcessor:
    """Stands in for Qwen3VLProcessor, which needs torchvision (not installable here) for its video half: its
    image processor is transformers', its video processor ours (`model.qwen_video`, checked against transformers'
    in tests/test_qwen_video.py), and `create_mm_token_type_ids` transformers' own function over the pad ids."""

    create_mm_token_type_ids = ProcessorMixin.create_mm_token_type_ids

    def __init__(self, image_processor: Qwen2VLImageProcessorPil, video_processor: QwenVideoProcessor,
                 tokenizer: Qwen2TokenizerFast):
        self.image_processor = image_processor
        self.video_processor = video_processor
        self.image_token_ids = [tokenizer.convert_tokens_to_ids("<|image_pad|>")]
        self.video_token_ids = [tokenizer.convert_tokens_to_ids("<|video_pad|>")]
        self.audio_token_ids = []


def oracle_pipeline(root: Path, transformer_name: str):
    """diffusers' MiniMaxH3Blocks over the tiny diffusers root's components, loaded by the libraries themselves."""
    tokenizer = Qwen2TokenizerFast.from_pretrained(root / "tokenizer")
    pipeline = MiniMaxH3Blocks().init_pipeline()
    pipeline.update_components(
        **{transformer_name: MiniMaxH3Transformer3DModel.from_pretrained(root / transformer_name,
                                                                                  torch_dtype=torch.bfloat16)},
        scheduler=MiniMaxH3Scheduler.from_pretrained(root / "scheduler"),
        audio_scheduler=MiniMaxH3Scheduler.from_pretrained(root / "audio_scheduler"),
        text_encoder=Qwen3VLForConditionalGeneration.from_pretrained(root / "text_encoder", dtype=torch.bfloat16),
        tokenizer=tokenizer,
        processor=StandInProcessor(Qwen2VLImageProcessorPil.from_pretrained(root / "processor"),
                                   QwenVideoProcessor.from_pretrained(root / "processor"), tokenizer),
        vae=VideoDecoder(root / "vae", "cpu").vae,
        audio_vae=AutoencoderKLMiniMaxH3Audio.from_pretrained(root / "audio_vae"),
        image_processor=VaeImageProcessor(vae_scale_factor=16),
        **TINY_CANVAS,
    )
    return pipeline


@dataclass(frozen=True)
class OracleRun:
    """diffusers' generation: video latents [C, F, H, W], audio latents [2, Ca, A], frames uint8 [F, H, W, 3],
    the stereo waveform float32 [2, samples]."""

    video: torch.Tensor
    audio: torch.Tensor
    frames: np.ndarray
    waveform: np.ndarray


def run_oracle(pipeline, seed: int, **inputs) -> OracleRun:
    out = pipeline(prompt=PROMPT, **inputs, num_frames=NUM_FRAMES, num_inference_steps=STEPS,
                   generator=torch.Generator().manual_seed(seed),
                   output=["latents", "audio_latents", "videos", "audio"])
    videos = out["videos"]
    frames = np.stack([np.asarray(frame) for frame in videos[0]]) if isinstance(videos, list) else videos
    return OracleRun(out["latents"][0], out["audio_latents"], frames, out["audio"][0].float().cpu().numpy())


def channels_to_rows(audio: torch.Tensor) -> torch.Tensor:
    """Audio latents [2, Ca, A] (diffusers' per-channel batch) as ditserve's rows [2A, Ca] (left's, then right's)."""
    return audio.permute(0, 2, 1).reshape(-1, audio.shape[1])


@dataclass
class Ours:
    """ditserve's side of one checkpoint partition, loaded by `model/`."""

    checkpoint: H3Checkpoint
    transformer: MiniMaxH3Transformer3DModel
    prompt_encoder: PromptEncoder
    encoders: ConditionEncoders
    video_decoder: VideoDecoder
    audio_decoder: AudioDecoder

    @classmethod
    def load(cls, root: Path, partition: Partition) -> Ours:
        checkpoint = H3Checkpoint.open(root, partition, require_components=True)
        weights = TransformerWeights(checkpoint.transformer_dir, checkpoint.layout)
        prompt_encoder = PromptEncoder(checkpoint.text_encoder_dir, checkpoint.tokenizer_dir, "cpu", vision=True,
                                       processor_dir=checkpoint.processor_dir)
        video_decoder = VideoDecoder(checkpoint.video_vae_dir, "cpu")
        audio_decoder = AudioDecoder(checkpoint.audio_vae_dir, "cpu")
        encoders = ConditionEncoders(prompt_encoder.tokenizer, prompt_encoder.image_processor,
                                     VisualConditionEncoder(video_decoder.vae),
                                     AudioConditionEncoder(audio_decoder.vae), prompt_encoder.video_processor)
        return cls(checkpoint, load_transformer(weights, "cpu"), prompt_encoder, encoders, video_decoder,
                   audio_decoder)

    def prepare(self, conditioning: Conditioning) -> PreparedConditioning:
        return prepare_conditioning(conditioning, PROMPT, None, NUM_FRAMES, CanvasRule.of(self.checkpoint),
                                    TINY_LIMITS, self.encoders)

    def generate(self, conditioning: Conditioning, seed: int) -> tuple[torch.Tensor, torch.Tensor, PreparedConditioning]:
        prepared = self.prepare(conditioning)
        embeds = self.prompt_encoder.encode_presentation(prepared.presentation)
        schedule = prepared.schedule(STEPS, self.checkpoint.video_shift, self.checkpoint.audio_shift)
        with torch.no_grad():
            video, rows = denoise(self.transformer, embeds, prepared.geometry, schedule, seed, prepared.conditions)
        return video, audio_rows_to_channels(rows, prepared.geometry), prepared


def random_image(width: int, height: int, seed: int) -> Image.Image:
    """A smooth random RGB image (so resizing matters), deterministic in `seed`."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)


def random_video(num_frames: int, width: int, height: int, seed: int) -> np.ndarray:
    """Smooth random uint8 frames [F, H, W, 3] that drift frame to frame (so sampling and resizing both matter)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(num_frames, max(2, height // 8), max(2, width // 8), 3)).astype(np.float32)
    coarse = torch.from_numpy(np.cumsum(coarse, axis=0) % 256).permute(0, 3, 1, 2)
    frames = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)
    return frames.permute(0, 2, 3, 1).round().clamp(0, 255).to(torch.uint8).numpy()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def generated_once(ours: dict[str, Ours], cases: dict, seed: int):
    """`generate(layout, case)`: ditserve's generation of `cases[case]` at `seed` in a layout, run once per module
    (the oracle test and the layouts test compare the same run)."""
    runs = {}

    def generate(layout: str, case: str):
        if (layout, case) not in runs:
            runs[layout, case] = ours[layout].generate(cases[case][0], seed=seed)
        return runs[layout, case]
    return generate


def wav(seconds: float, rate: int = 16000) -> bytes:
    """A mono 16-bit WAV (a sine): a reference soundtrack the server resamples to 32 kHz."""
    out = io.BytesIO()
    with av.open(out, "w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=rate, layout="mono")
        samples = (np.sin(np.arange(int(seconds * rate)) * 0.05) * 8000).astype(np.int16)[None]
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return out.getvalue()


def video_file(frames: np.ndarray, fps: int, soundtrack_seconds: float | None = None, rate: int = 32000) -> bytes:
    """`frames` (uint8 [F, H, W, 3]) as a lossless Matroska file (FFV1, RGB), with a 16-bit sine soundtrack at
    `rate` if `soundtrack_seconds`: what decoding gives back is `frames` exactly and `soundtrack(...)`."""
    out = io.BytesIO()
    with av.open(out, "w", format="matroska") as container:
        stream = container.add_stream("ffv1", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "bgr0"
        audio = None
        if soundtrack_seconds is not None:
            audio = container.add_stream("pcm_s16le", rate=rate, layout="mono")
        for pixels in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        container.mux(stream.encode(None))
        if audio is not None:
            frame = av.AudioFrame.from_ndarray(soundtrack_samples(soundtrack_seconds, rate), format="s16",
                                               layout="mono")
            frame.sample_rate = rate
            for packet in [*audio.encode(frame), *audio.encode(None)]:
                container.mux(packet)
    return out.getvalue()


def soundtrack_samples(seconds: float, rate: int) -> np.ndarray:
    """The int16 mono sine `video_file` writes: [1, S]."""
    return (np.sin(np.arange(int(seconds * rate)) * 0.05) * 8000).astype(np.int16)[None]
