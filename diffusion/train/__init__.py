"""Train: the Composer trainer and its batch sources (stored MDS shards, or the online stream)."""
