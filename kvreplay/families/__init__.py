"""The pool families, a folder each (sglang/, vllm/): a family's own code, named by the
record its package registers (kvreplay/contract/ says what a record holds)."""
