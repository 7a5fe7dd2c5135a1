"""The core model: dtypes, tensor descriptors, the checkpoint, findings and errors. No I/O."""
