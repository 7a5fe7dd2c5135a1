"""Writers execute plans: streamed, verified shards in a staging folder swapped in atomically."""
