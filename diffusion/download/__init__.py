"""Download: url+caption lists → img2dataset-compatible image shards."""
