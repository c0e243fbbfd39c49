"""Hugging Face caches that replay: graph-safe sliding-window layers, which layer kinds replay, the
encoder-decoder filling step, the keyword a cache travels under. Used by graphrt.hf; every module
but ``cross_attention`` and ``cache_keyword`` imports transformers, so import them from where they
are needed (``import graphrt`` never imports transformers).
"""
