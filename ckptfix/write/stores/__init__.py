"""Object stores as outputs (`-o s3://…`, `gs://…`, `hf://…`): see `base`."""
