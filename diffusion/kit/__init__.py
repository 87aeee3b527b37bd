"""The offline kit: model directories, the CLIP tokenizer and sample data, made without the hub."""
