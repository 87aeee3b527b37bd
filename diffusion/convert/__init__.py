"""Convert: raw image-caption rows → crops and tokens → VAE moments and text embeddings → MDS."""
