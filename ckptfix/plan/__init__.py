"""Plans are data: which tensors go where under which names, decided before writing."""
