"""verispec: batched speculative decoding you can check.

Dimension glossary used in every shape comment of the package:
    B batch (rows in one forward pass)    K draft length (tokens proposed per row)
    V vocabulary                          T time (tokens per row in one forward pass)
    S key/value length attended to        L layers
    H attention heads (Hkv: key/value heads)  D head dimension   E hidden size
    R rows allocated in a KV cache
"""

__version__ = "0.1.0"
