"""The clients that move payload bytes faster than fsspec, one family per module.

:mod:`~spot_callbacks.store.dataplane` chooses among them; each builds its client from the fsspec
filesystem the store already has, and refuses (:class:`~spot_callbacks.store.clients.base.Unsupported`)
whatever it cannot honour, so the store falls back to fsspec instead of guessing:

- :mod:`~spot_callbacks.store.clients.base`: what a data plane does, the transfer buffer budget.
- :mod:`~spot_callbacks.store.clients.streams`: a stream of chunks to a local file, hashed as it arrives.
- :mod:`~spot_callbacks.store.clients.obstores`: obstore (Rust, one streamed GET per file) and its errors.
- :mod:`~spot_callbacks.store.clients.s3`: ``s3://``: boto3's s3transfer uploads, obstore pulls, from s3fs.
"""
