"""Download a LAION-style url+caption list into image shards (img2dataset-compatible), with Ray Data.

    python convert/download_laion.py --input laion/part-00000.parquet --output out/raw
    python convert/download_laion.py --input s3://bucket/urls/ --output out/raw --resize-mode center_crop \\
        --image-size 512 --address auto

Re-running the same command resumes: finished shards are skipped. All logic lives in
diffusion.download.job (``--help`` lists every flag).
"""

from diffusion import cli
from diffusion.download.job import main

if __name__ == "__main__":
    cli.run(main, "download_laion", resumable=True)
