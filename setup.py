"""Stable Diffusion pre-training from scratch: Ray Data conversion, Composer training, streaming MDS.

`make test` / `make demo` install the exact pinned set from requirements.lock; the ranges below are
what the code supports (torch 2.7 with transformers 4.57 here, torch 2.11 with transformers 5 on GPUs).
"""

from setuptools import find_packages, setup

setup(
    name="diffusion",
    version="0.1.0",
    description="Stable Diffusion pre-training from scratch at scale (Composer, streaming, Ray Data)",
    python_requires=">=3.11",
    packages=find_packages(include=["diffusion", "diffusion.*"]),
    package_data={"diffusion.kit": ["assets/tiny-vae/*", "assets/tiny-vae16/*", "assets/tiny-dcae/*", "assets/tiny-clip-heads/*"]},  # the fitted
    # tiny autoencoders the tiny, tiny-flux and tiny-sana kits copy
    # `pip install .` puts the commands on PATH by name; each is also `python -m` / a script in convert/.
    entry_points={"console_scripts": [
        f"{name} = diffusion.cli:{name.replace('-', '_')}"
        for name in ("sd-download", "sd-convert", "sd-train", "sd-online", "sd-generate", "sd-export",
                     "sd-evaluate", "sd-cost", "sd-kit", "sd-sample-data", "sd-demo",
                     "sd-posthoc-ema")]},
    install_requires=[
        "torch>=2.6",
        "torchvision",
        "diffusers>=0.39",
        "transformers>=4.57",
        "mosaicml>=0.32.1",
        "mosaicml-streaming>=0.13.0",
        "ray[data,train]>=2.60",
        "open_clip_torch",  # ships the CLIP BPE vocabulary the kit's tokenizer is rebuilt from
        "pyarrow",
        "pillow",
        "numpy",
        "pyyaml",
        "tqdm",
        "scipy",
    ],
    extras_require={
        "wandb": ["wandb"],
        "s3": ["boto3"],
        "test": ["pytest", "pytest-timeout", "moto[server]", "boto3"],
    },
)
