"""What a run trains on: tokenizers, corpora, datasets and batching (`datasets.py`), and the
files a directory contributes to a corpus (`corpus_files.py`)."""
