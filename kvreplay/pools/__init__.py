"""kvreplay's own reference pools, written from scratch in torch after sglang's
allocators' behaviour (token.py, paged.py, swa.py), bug variants that each override
one hook (variants.py), and their ``builtin:`` names (registry.py)."""
