"""Online mode's training side: the converter's operators streamed live (stream_source) into Ray Train
ranks that each run the same Composer trainer as run.py (ray_workers)."""
