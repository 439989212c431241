"""Pretrained diffusers pipelines as the model: which family a pipeline folder holds (families.py) and its
denoiser, called as every lit-dist denoiser is (denoiser.py)."""
