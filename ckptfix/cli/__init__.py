"""The thin command-line layer: Typer options in, one core call, rendering out."""
