"""The library: read any checkpoint lazily (`reader`), write verified shards from memory
(`save`, `writer`). `ckptfix.open`, `ckptfix.save` and `ckptfix.Writer` are these."""
