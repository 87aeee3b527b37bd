"""Stable Diffusion pre-training from scratch on Composer, mosaicml-streaming and Ray Data."""

__version__ = "0.1.0"
