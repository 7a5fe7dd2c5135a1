"""Readers (and later writers) for each checkpoint format, one module per format."""
