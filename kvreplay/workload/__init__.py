"""The decode-server model: scenarios that drive a pool as an SGLang server does,
and ``synth``, which records them into traces."""
