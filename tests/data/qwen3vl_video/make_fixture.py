"""Write fixture.safetensors: transformers' Qwen3VLVideoProcessor on synthetic videos, called as diffusers calls it.

Run on a machine with torch, torchvision, transformers, numpy and safetensors (no diffusers, pydantic or ditserve
needed); it imports nothing else:

    python tests/data/qwen3vl_video/make_fixture.py [OUT_DIR]

For each case it stores the uint8 input videos (T, H, W, 3), the processor's `pixel_values_videos` and
`video_grid_thw`, and torchvision's bicubic antialiased resize of each video to the size the grid implies (to tell a
resize difference from a normalize/patchify one). A case whose pixel values would be large stores their sha256 instead
of the tensor. The metadata key "fixture" holds a json: versions, CPU capability (the uint8 resize kernel depends on it),
each case's processor config (`to_dict()`) and the hashes.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torchvision
import transformers
from safetensors.torch import save_file
from torchvision.transforms.v2 import functional as tvF
from transformers import Qwen3VLVideoProcessor

#: The tiny checkpoint's video processor (model/tiny_components.py; it matches the tiny image processor: patch 4,
#: merge 2, temporal patch 2). Kept in sync by hand: this script must not import ditserve.
TINY = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2,
        "size": {"shortest_edge": 256, "longest_edge": 16384}}
#: transformers' own defaults (the released Qwen3-VL video processor, as far as we know its config).
DEFAULTS: dict = {}

#: name -> (processor config, [(frames, height, width), ...] one per video of the batch, store pixel values?)
CASES = {
    "tiny_exact": (TINY, [(4, 32, 48)], True),            # sizes already on the grid: no resize
    "tiny_odd": (TINY, [(5, 37, 53)], True),              # odd sizes, frames not a multiple of the temporal patch
    "tiny_downscale": (TINY, [(3, 90, 130)], True),       # over the pixel budget: antialiased downscale
    "tiny_small_frames": (TINY, [(2, 6, 10)], True),      # under the patch factor
    "tiny_batch": (TINY, [(4, 32, 40), (6, 24, 56), (4, 32, 40)], True),  # grouped by shape, order kept
    "defaults_small": (DEFAULTS, [(2, 24, 40)], False),   # min-pixels upscale at the released patch size
    "defaults_odd": (DEFAULTS, [(3, 45, 70)], False),
}


def synthetic_video(seed: int, frames: int, height: int, width: int) -> np.ndarray:
    """Seeded uint8 noise over a moving gradient: detail for the resize kernel, structure across frames."""
    rng = np.random.default_rng(seed)
    t, y, x = np.meshgrid(np.arange(frames), np.arange(height), np.arange(width), indexing="ij")
    base = np.stack([(x * 7 + t * 13) % 256, (y * 5 + t * 29) % 256, (x * 3 + y * 11) % 256], axis=-1)
    noise = rng.integers(-60, 61, size=base.shape)
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def main(out_dir: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    meta: dict = {"versions": {"torch": torch.__version__, "torchvision": torchvision.__version__,
                               "transformers": transformers.__version__, "numpy": np.__version__},
                  "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cases": {}}
    for case_index, (name, (config, shapes, store_pixels)) in enumerate(CASES.items()):
        processor = Qwen3VLVideoProcessor(**config)
        videos = [synthetic_video(1000 * case_index + k, *shape) for k, shape in enumerate(shapes)]
        out = processor(videos=videos, do_sample_frames=False, return_tensors="pt")  # as diffusers' ref2va step
        pixels, grid = out["pixel_values_videos"], out["video_grid_thw"]
        for k, video in enumerate(videos):
            tensors[f"{name}.input.{k}"] = torch.from_numpy(video)
            _, grid_h, grid_w = (int(v) for v in grid[k])
            chw = torch.from_numpy(video).permute(0, 3, 1, 2).contiguous()
            size = [grid_h * processor.patch_size, grid_w * processor.patch_size]
            tensors[f"{name}.resized.{k}"] = tvF.resize(chw, size, interpolation=tvF.InterpolationMode.BICUBIC,
                                                        antialias=True).contiguous()
        tensors[f"{name}.video_grid_thw"] = grid.to(torch.int64).contiguous()
        if store_pixels:
            tensors[f"{name}.pixel_values_videos"] = pixels.contiguous()
        meta["cases"][name] = {"config": json.loads(processor.to_json_string()), "num_videos": len(videos),
                               "pixel_values_shape": list(pixels.shape), "pixel_values_dtype": str(pixels.dtype),
                               "pixel_values_sha256": sha256(pixels)}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "fixture.safetensors"
    save_file(tensors, str(path), metadata={"fixture": json.dumps(meta, sort_keys=True)})
    print(f"wrote {path} ({path.stat().st_size} bytes); versions {meta['versions']}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent)
