"""Corpora as token stores: source documents, tokenizers, tokenizing, and the island shards streamed from a store."""
