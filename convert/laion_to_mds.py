"""Convert raw image-caption data (parquet, webdataset tars, image folders) into MDS shards of VAE
moments and text embeddings.

    python convert/laion_to_mds.py --input IN --output OUT --model REF [--resolutions 256 512] [...]

Re-running the same command after a kill resumes: the output ends up with exactly the samples of a
clean run. The flags live in diffusion.convert.config (``--help`` lists every flag), the pipeline in
diffusion.convert.pipeline.
"""

from diffusion import cli
from diffusion.convert.command import main

if __name__ == "__main__":
    cli.run(main, "laion_to_mds", resumable=True)
