"""How a folder is organised into checkpoints (Hugging Face names today)."""
