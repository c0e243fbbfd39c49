"""Hugging Face caches that replay: graph-safe sliding-window layers, which layer kinds replay, the
encoder-decoder filling step. Used by graphrt.hf; every module but ``cross_attention`` imports
transformers, so import them from where they are needed (``import graphrt`` never imports transformers).
"""
