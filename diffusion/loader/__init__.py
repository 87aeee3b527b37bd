"""Batch sources for training: stored MDS shards (mds_source, with each dataset's dataset.json checked by
dataset_info and each shard by shard_checks) or the converter's operators streamed live (stream_source);
both hand their columns to batches, which makes the model's batch and every per-sample draw."""
