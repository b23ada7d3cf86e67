"""MiniMax-H3 built from diffusers' and transformers' own classes: checkpoint layouts and lazy weights, the
transformer's loading and AdaLN split, request geometry, schedule, packing and the denoising loop, the Qwen3-VL
prompt encoder, VAE decoding and MP4 muxing, and tiny random checkpoints for tests (no Ray, nothing of ours above)."""
