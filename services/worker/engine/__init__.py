"""The worker's serving engine: paged KV, continuous batching, chunked prefill, prefix caching.

``Engine`` (engine.py) is the entry point; the request and result types live in request.py.
"""
